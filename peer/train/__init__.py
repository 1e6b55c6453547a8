"""Local training: everything a peer does between two syncs, on its own device. Nothing here touches the swarm's
network (``source.py`` may fetch a model from the Hugging Face hub).

- ``source.py``     where the model and tokenizer come from (a preset, a Hugging Face directory or hub name), pinned
- ``model.py``      the model from a preset's or a Hugging Face config, fresh or from its weights
- ``llama.py``      the presets' Llama in plain torch: transformers' LlamaForCausalLM without its 3-s import
- ``tokenizer.py``  bytes, GPT-2's BPE, or a Hugging Face tokenizer; each as transformers saves it
- ``data.py``       bundled/local/streamed text, held-out split, per-peer order
- ``inner.py``      the inner AdamW loop (warmup + cosine, clipping, accumulation, bf16 on GPU)
- ``optim.py``      torch's AdamW called eagerly: no ``torch._dynamo`` import on a restart's path
- ``island.py``     a multi-process peer under torchrun: DDP inside, rank 0 speaks for the island
- ``flat.py``       flat fp32 CPU vectors for G, m, pseudo-gradients and moments (pinned copies from GPUs)
- ``local.py``      theta as the sync sees it, with or without overlap (frozen copy, eager start, shifts)
- ``build.py``      the corpus and trainer of a run on this node's device (rank 0 and the other ranks alike)
"""
