"""Interoperability with other frameworks' model files.

    huggingface   export_hf / load_hf: the canonical state <-> a Hugging Face directory, by model.arch
    gpt2          export_gpt2 / load_gpt2: GPT2LMHeadModel directories
    gpt2_config   GPT-2's config.json and the checks that a directory fits a model
    llama         export_llama / load_llama: LlamaForCausalLM directories, their config.json and its checks
    mixtral       export_mixtral / load_mixtral: MixtralForCausalLM directories (model.arch=llama with model.moe)
    hf_files      what every such directory has: config.json, weights, tokenizer files; HFFormatError
"""
