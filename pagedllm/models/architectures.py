"""What each supported architecture changes in the one decoder (:mod:`pagedllm.models.decoder`).

Every architecture here is a transformer decoder with causal multi-head attention and an
MLP, each added to a residual stream; they differ in a few parts, named by
:class:`ArchitectureSpec`. Numbers that vary
per checkpoint (soft-caps, multipliers, windows) live in
:class:`~pagedllm.models.config.ModelConfig`; the spec holds what is fixed per
architecture and which config keys carry those numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a layer's norms sit:
# "pre": norm -> attention -> residual add; norm -> MLP -> residual add (Llama).
# "sandwich": norm -> attention -> norm -> residual add; same around the MLP (Gemma 2/3).
# "post": attention -> norm -> residual add; MLP -> norm -> residual add (OLMo 2).
# "parallel": attention and MLP both read the same residual stream, each through its own
#   norm, and both outputs are added to it (GPT-NeoX, Falcon's new decoder).
# "parallel_shared": the same with one norm feeding both (StableLM, Falcon 7B).
NORM_LAYOUTS = ("pre", "sandwich", "post", "parallel", "parallel_shared")
# What a norm computes over the hidden vector x: "rms" (x / rms(x) * w), "layer"
# ((x - mean) / std * w + b, LayerNorm with weight and bias) or "layer_plain" (LayerNorm
# without weights, OLMo's, its epsilon fixed at 1e-5).
NORM_KINDS = ("rms", "layer", "layer_plain")
# Per-layer tensor names of the norms, in the order the layout uses them.
NORM_NAMES = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "parallel": ("input_layernorm", "post_attention_layernorm"),
    "parallel_shared": ("input_layernorm",),
}


@dataclass(frozen=True)
class ArchitectureSpec:
    """The fixed parts of one Hugging Face ``model_type``.

    - ``norm_layout``: one of :data:`NORM_LAYOUTS` (a config may change it, see
      :mod:`pagedllm.models.config_variants`); ``norm``: one of :data:`NORM_KINDS`.
    - ``qk_norm``: ``None``; ``"head"`` (an RMSNorm over each head of q and of k, weights
      ``[head_dim]``, Qwen3 and Gemma 3); ``"projection"`` (over the whole q and k
      projections, weights ``[q_size]`` and ``[kv_size]``, OLMo 2); ``"layer_head"`` (a
      LayerNorm without bias over each head, weights ``[heads, head_dim]``: one per head,
      StableLM's ``qk_layernorm``). Before RoPE.
    - ``gated_mlp``: the MLP is ``down(act(gate(x)) * up(x))``; otherwise ``down(act(up(x)))``.
    - ``positions``: ``"rope"`` (rotary, on the leading ``partial_rotary_factor`` of each
      head when ``partial_rotary``) or ``"learned"`` (an absolute position embedding added
      to the token embedding, GPT-2).
    - ``config_keys``: the architecture's own names of config keys, as pairs (Hugging Face
      name, this architecture's name), e.g. GPT-2's ``("hidden_size", "n_embd")``.
    - ``norm_eps_key`` / ``default_norm_eps``: the config key of the norms' epsilon and its
      value when absent (``None``: always the default).
    - ``kv_heads_key``: the config key of the key/value head count (``None``: as many as
      query heads, whatever the config holds).
    - ``unused_suffixes``: checkpoint tensor name endings that hold no weights (old causal
      mask buffers).
    - ``norm_offset``: RMSNorms multiply by ``offset + weight`` (Gemma: 1).
    - ``embedding_scaled``: embeddings are multiplied by ``sqrt(hidden_size)`` rounded
      to the model dtype (Gemma).
    - ``fused_projections``: q/k/v are stored as one ``qkv_proj`` and gate/up as one
      ``gate_up_proj`` (Phi-3).
    - ``qkv_bias_always``: q/k/v biases whatever the config says (Qwen2); otherwise
      ``attention_bias`` gives q/k/v *and* o biases.
    - ``activation_key``: the config key naming the MLP's gate activation, and
      ``default_activation`` its value when absent; ``gelu_means_tanh``: a legacy
      ``"gelu"`` there means the tanh approximation (Gemma).
    - ``window_rule``: how layers get a sliding window: ``None`` (never), ``"all"``
      (``sliding_window`` on every layer), ``"qwen"`` (``use_sliding_window``, then
      ``layer_types`` or the layers from ``max_window_layers`` on), ``"qwen2_moe"``
      (the same, but odd-numbered layers below ``max_window_layers``), ``"layer_types"``
      (``layer_types``, else every ``window_pattern``-th layer global).
    - ``math_keys``: config keys carrying numbers this architecture's decoder reads
      (soft-caps, multipliers, ``query_pre_attn_scalar``, expert counts).
    - ``qkv_bias_key``: the config key (default true) giving q/k/v biases and no o bias
      (Qwen2-MoE's ``qkv_bias``).
    - ``moe``: ``None``, ``"mixtral"`` (every MLP sparse, ``block_sparse_moe.experts.E.w1/
      w3/w2``, router probabilities renormalised over the top k) or ``"qwen"`` (sparse
      MLPs by ``decoder_sparse_step`` and ``mlp_only_layers``, ``mlp.experts.E.gate_proj/
      up_proj/down_proj``, ``norm_topk_prob``); ``shared_expert``: Qwen2-MoE's gated one.
    """

    norm_layout: str = "pre"
    qk_norm: str | None = None
    norm_offset: float = 0.0
    embedding_scaled: bool = False
    fused_projections: bool = False
    qkv_bias_always: bool = False
    activation_key: str = "hidden_act"
    default_activation: str = "silu"
    gelu_means_tanh: bool = False
    window_rule: str | None = None
    window_pattern: int = 0
    default_window: int | None = None
    math_keys: tuple[str, ...] = ()
    qkv_bias_key: str | None = None
    moe: str | None = None
    shared_expert: bool = False
    norm: str = "rms"
    gated_mlp: bool = True
    positions: str = "rope"
    partial_rotary: bool = False
    config_keys: tuple[tuple[str, str], ...] = ()
    norm_eps_key: str | None = "rms_norm_eps"
    default_norm_eps: float = 1e-6
    kv_heads_key: str | None = "num_key_value_heads"
    unused_suffixes: tuple[str, ...] = ()


GEMMA_KEYS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(),
    "mistral": ArchitectureSpec(window_rule="all", default_window=4096),
    "qwen2": ArchitectureSpec(qkv_bias_always=True, window_rule="qwen", default_window=4096),
    "qwen3": ArchitectureSpec(qk_norm="head", window_rule="qwen", default_window=4096),
    "gemma": ArchitectureSpec(
        norm_offset=1.0,
        embedding_scaled=True,
        default_activation="gelu_pytorch_tanh",
        gelu_means_tanh=True,
    ),
    "gemma2": ArchitectureSpec(
        norm_layout="sandwich",
        norm_offset=1.0,
        embedding_scaled=True,
        activation_key="hidden_activation",
        default_activation="gelu_pytorch_tanh",
        window_rule="layer_types",
        window_pattern=2,
        default_window=4096,
        math_keys=GEMMA_KEYS,
    ),
    "gemma3_text": ArchitectureSpec(
        norm_layout="sandwich",
        qk_norm="head",
        norm_offset=1.0,
        embedding_scaled=True,
        activation_key="hidden_activation",
        default_activation="gelu_pytorch_tanh",
        window_rule="layer_types",
        window_pattern=6,
        default_window=4096,
        math_keys=GEMMA_KEYS,
    ),
    "olmo2": ArchitectureSpec(norm_layout="post", qk_norm="projection"),
    "granite": ArchitectureSpec(
        math_keys=(
            "embedding_multiplier",
            "residual_multiplier",
            "attention_multiplier",
            "logits_scaling",
        )
    ),
    "phi3": ArchitectureSpec(fused_projections=True, window_rule="all"),
    "mixtral": ArchitectureSpec(
        window_rule="all", moe="mixtral", math_keys=("num_local_experts",)
    ),
    "qwen2_moe": ArchitectureSpec(
        qkv_bias_key="qkv_bias",
        window_rule="qwen2_moe",
        default_window=4096,
        moe="qwen",
        shared_expert=True,
        math_keys=("num_experts",),
    ),
    "qwen3_moe": ArchitectureSpec(
        qk_norm="head", window_rule="qwen", default_window=4096, moe="qwen",
        math_keys=("num_experts", "num_local_experts"),
    ),
}
# LayerNorm decoders (GPT-NeoX, StableLM, OLMo, GPT-2, Falcon).
ARCHITECTURES.update(
    stablelm=ArchitectureSpec(
        norm="layer", partial_rotary=True, norm_eps_key="layer_norm_eps", default_norm_eps=1e-5
    ),
    gpt_neox=ArchitectureSpec(
        norm_layout="parallel",
        norm="layer",
        gated_mlp=False,
        default_activation="gelu",
        partial_rotary=True,
        norm_eps_key="layer_norm_eps",
        default_norm_eps=1e-5,
        kv_heads_key=None,
        unused_suffixes=(".attention.bias", ".attention.masked_bias"),
    ),
    olmo=ArchitectureSpec(
        norm="layer_plain", norm_eps_key=None, default_norm_eps=1e-5, math_keys=("clip_qkv",)
    ),
    gpt2=ArchitectureSpec(
        norm="layer",
        gated_mlp=False,
        positions="learned",
        activation_key="activation_function",
        default_activation="gelu_new",
        config_keys=(
            ("hidden_size", "n_embd"),
            ("num_hidden_layers", "n_layer"),
            ("num_attention_heads", "n_head"),
            ("max_position_embeddings", "n_positions"),
            ("intermediate_size", "n_inner"),
        ),
        norm_eps_key="layer_norm_epsilon",
        default_norm_eps=1e-5,
        kv_heads_key=None,
        unused_suffixes=(".attn.bias", ".attn.masked_bias"),
    ),
    falcon=ArchitectureSpec(
        norm_layout="parallel_shared",
        norm="layer",
        gated_mlp=False,
        activation_key="activation",
        default_activation="gelu",
        config_keys=(("intermediate_size", "ffn_hidden_size"),),
        norm_eps_key="layer_norm_epsilon",
        default_norm_eps=1e-5,
        kv_heads_key=None,  # by its layout: see config_variants
    ),
)
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
