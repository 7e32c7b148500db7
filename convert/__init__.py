"""Conversion of Gated DeltaNet checkpoints into ResLin models: `python -m convert --help`.

One module per source layout (`fla`: FLA's GatedDeltaNetForCausalLM; `litgpt`: NVlabs' lit_gpt
GatedDeltaNet), and `common` for what they share: reading weight files, validation, sharded
safetensors writing, the staged (all-or-nothing) destination folder and the upcycling probe.
Not loaded by remote code.
"""
