"""Interoperability with other frameworks' model files.

    gpt2          export_gpt2 / load_gpt2: the canonical state <-> a Hugging Face GPT-2 directory
    gpt2_config   config.json and tokenizer files of such a directory, and the checks that it fits a model
"""
