"""What a peer prints for each round: plain text, whatever an error's text holds."""

import json

from peer.ops.report import Reporter

DIAL_ERROR = ("state download failed (ControlFailure('failed to dial QmX: all dials failed\\n"
              "  * [/ip4/127.0.0.1/tcp/33155] dial backoff'))")


def test_a_round_whose_error_holds_a_multiaddr_is_printed_and_logged_as_it_is(tmp_path, capsys):
    """rich read "[/ip4/...]" as a closing markup tag and raised, killing the peer mid-run (seen in CI)."""
    metrics = tmp_path / "m.jsonl"
    record = dict(epoch=5, loss=2.5, eval_loss=None, group_size=0, tokens_per_second=250.0, bytes_sent=1000,
                  bytes_received=2000, sync_seconds=0.5, state_hash="f8ef30bc00", applied=False, error=DIAL_ERROR)
    reporter = Reporter(str(metrics), quiet=True)
    reporter.round(record)
    reporter.info("peers at [/ip4/10.0.0.1/tcp/4001] and [bold]")
    err = capsys.readouterr().err.replace("\n", "")
    assert "[/ip4/127.0.0.1/tcp/33155] dial backoff" in err and "[/ip4/10.0.0.1/tcp/4001] and [bold]" in err
    assert json.loads(metrics.read_text())["error"] == DIAL_ERROR
