"""Interoperability with other frameworks' model files.

    huggingface   export_hf / load_hf: the canonical state <-> a Hugging Face directory, by model.arch
    gpt2          export_gpt2 / load_gpt2: GPT2LMHeadModel directories
    gpt2_config   GPT-2's config.json and the checks that a directory fits a model
    llama         export_llama / load_llama: LlamaForCausalLM directories, their config.json and its checks
    mixtral       export_mixtral / load_mixtral: MixtralForCausalLM directories (model.arch=llama with model.moe)
    qwen2_moe     export_qwen2 / load_qwen2: Qwen2MoeForCausalLM (model.moe with a shared expert) and dense
                  Qwen2ForCausalLM (model.qkv_bias) directories
    hf_files      what every such directory has: config.json, weights, tokenizer files; HFFormatError
    job_state     a whole job moved between frameworks (weights, Adam's moments and count, iteration): JobState
    torchtitan_dcp    torchtitan's DCP step-N directories (Llama)
    megatron_dist     Megatron-core torch_dist iter_N directories (GPT-2)
    megatron_legacy   Megatron-LM's mp_rank_XX/model_optim_rng.pt (GPT-2; weights and iteration)
"""
