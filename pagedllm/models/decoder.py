"""The one decoder of every supported architecture, over a flattened batch.

Llama 2/3, Mistral, Qwen2/3, SmolLM2, Gemma 1/2/3, OLMo 1/2, Granite, Phi-3, the
mixtures of experts, StableLM, GPT-NeoX, GPT-2 and Falcon are one transformer with
causal attention and an MLP; what an architecture changes (norm kind and layout, parallel
residual, q/k norms, norm offset, partial rotary or learned positions, activation, gated
or plain MLP, scalings, soft-caps, windows, clipping, tensor names) is read from its
:class:`~pagedllm.models.architectures.ArchitectureSpec` and the
:class:`~pagedllm.models.config.ModelConfig` numbers, never from a copy of the model.
Tokens of many sequences arrive concatenated as one ``[num_tokens]`` batch with their
positions; attention is delegated to an :class:`AttentionBackend`, so the decoder itself
holds no KV state. Weights are fused at load time (q/k/v into one matrix, gate/up into
another) so a layer runs three matrix products plus the output projection.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpu.kernel_choice import KernelChoice
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.models.architectures import NORM_NAMES
from pagedllm.models.block_expansion import ExpandedBlocks
from pagedllm.models.config import ModelConfig
from pagedllm.models.fused import activation, add_rms_norm, gated_activation, rms_norm
from pagedllm.models.interleaved_weight import BlockWeight
from pagedllm.models.layer_stack import LayerStack
from pagedllm.models.linear import (
    PackedWeight,
    Weight,
    expanded_storage,
    fuse_rows,
    linear,
    prepare_weight,
    weight_storage,
)
from pagedllm.models.moe import SparseMoE
from pagedllm.models.norms import layer_norm_per_head, normalize
from pagedllm.models.partition import TensorPartition
from pagedllm.models.quantized_weight import QuantizedWeight
from pagedllm.models.rope import RotaryTable, apply_partial_rope
from pagedllm.models.sharded_weights import ShardedWeights

logger = logging.getLogger("pagedllm")

# Returns the tensor of a Hugging Face Llama-style parameter name, e.g.
# "model.layers.0.self_attn.q_proj.weight" (other architectures' checkpoints are read
# through pagedllm.models.checkpoint_names); raises ModelLoadError when absent.
WeightSource = Callable[[str], torch.Tensor]


def sparse_moe(
    config: ModelConfig, prefix: str, get: WeightSource, choice: KernelChoice
) -> SparseMoE:
    """The mixture-of-experts MLP of the layer whose names start with ``prefix``, from
    Mixtral's or Qwen's per-expert tensors."""
    if config.spec.moe == "mixtral":
        block = prefix + "block_sparse_moe."
        names = ("w1", "w3", "w2")  # gate, up, down
    else:
        block = prefix + "mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    experts = [f"{block}experts.{e}." for e in range(config.num_experts)]
    gate_up = torch.stack(
        [torch.cat([get(f"{e}{names[0]}.weight"), get(f"{e}{names[1]}.weight")]) for e in experts]
    )
    down = torch.stack([get(f"{e}{names[2]}.weight") for e in experts])
    shared = None
    if config.shared_expert_intermediate_size:
        expert = block + "shared_expert."
        shared = (
            torch.cat([get(expert + "gate_proj.weight"), get(expert + "up_proj.weight")]),
            get(expert + "down_proj.weight"),
            get(block + "shared_expert_gate.weight"),
        )
    return SparseMoE(
        get(block + "gate.weight"),
        gate_up,
        down,
        config.num_experts_per_tok,
        config.moe_renormalize,
        config.hidden_act,
        shared,
        choice,
    )


class DecoderLayer(nn.Module):
    """One block: attention and an MLP, each added to the residual stream, with the
    norms where the config's ``norm_layout`` puts them.

    Weights (plain or packed, see :func:`~pagedllm.models.linear.prepare_weight`):
    ``qkv_weight`` ``[q_size + 2 * kv_size, hidden]`` (rows q, then k, then v),
    ``o_weight`` ``[hidden, q_size]``, ``gate_up_weight`` ``[2 * intermediate, hidden]``
    (rows gate, then up; only up, ``[intermediate, hidden]``, for an MLP without a gate),
    ``down_weight`` ``[hidden, intermediate]``; a sparse layer has
    ``moe`` (:class:`~pagedllm.models.moe.SparseMoE`) instead of the last two. Buffers:
    biases of the same projections (``qkv_bias``, ``o_bias``, ``gate_up_bias``,
    ``down_bias``) or ``None``; the layout's norms under their Hugging Face names
    (``None`` for weightless norms) with their biases as ``<name>_bias`` (``None`` but for
    LayerNorms), ``q_norm`` / ``k_norm`` or ``None``, all holding ``offset + weight``.
    ``attention``: this layer's scale, sliding window and soft-cap; ``local_rope``: whether
    it rotates with the local rope. ``choice`` picks each matrix's kernel. ``dtype``: the
    model's, that of every norm's output and every matrix's input; the residual stream
    passed to :meth:`forward` may be float32 instead (:class:`CausalDecoder`).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        get: WeightSource,
        get_norm: WeightSource,
        choice: KernelChoice,
        dtype: torch.dtype,
        parallel: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.dtype = dtype
        self.parallel = parallel
        spec = config.spec
        windows = config.sliding_windows
        window = windows[layer_idx] if windows else None
        self.attention = AttentionOptions(
            scale=config.attention_scale or config.head_dim**-0.5,
            sliding_window=window,
            logit_softcap=config.attn_logit_softcap,
        )
        self.local_rope = window is not None and config.local_rope_theta is not None
        prefix = f"model.layers.{layer_idx}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.norm_names = NORM_NAMES[config.norm_layout]
        for name in self.norm_names:
            weighted = spec.norm != "layer_plain"
            self.register_buffer(name, get_norm(f"{prefix}{name}.weight") if weighted else None)
            bias = get(f"{prefix}{name}.bias") if spec.norm == "layer" else None
            self.register_buffer(name + "_bias", bias)
        q_norm = get_norm(attn + "q_norm.weight") if config.qk_norm else None
        self.register_buffer("q_norm", q_norm)
        self.register_buffer("k_norm", get_norm(attn + "k_norm.weight") if config.qk_norm else None)

        projections = ("q_proj", "k_proj", "v_proj")
        gate_up = ("gate_proj", "up_proj") if spec.gated_mlp else ("up_proj",)
        if spec.fused_projections or config.qkv_layout:
            qkv = get(attn + "qkv_proj.weight")
        else:
            qkv = fuse_rows([get(f"{attn}{p}.weight") for p in projections])
        self.qkv_weight: Weight = prepare_weight(qkv, choice)
        self.o_weight: Weight = prepare_weight(get(attn + "o_proj.weight"), choice)
        sparse = config.sparse_layers[layer_idx] if config.sparse_layers else False
        self.moe = sparse_moe(config, prefix, get, choice) if sparse else None
        self.gate_up_weight: Weight | None = None
        self.down_weight: Weight | None = None
        if not sparse:
            if spec.fused_projections:
                gate_up_weight = get(mlp + "gate_up_proj.weight")
            else:
                gate_up_weight = fuse_rows([get(f"{mlp}{p}.weight") for p in gate_up])
            self.gate_up_weight = prepare_weight(gate_up_weight, choice)
            self.down_weight = prepare_weight(get(mlp + "down_proj.weight"), choice)
        qkv_bias = None
        if config.attention_bias and config.qkv_layout:
            qkv_bias = get(attn + "qkv_proj.bias")
        elif config.attention_bias:
            qkv_bias = torch.cat([get(f"{attn}{p}.bias") for p in projections])
        self.register_buffer("qkv_bias", qkv_bias)
        self.register_buffer("o_bias", get(attn + "o_proj.bias") if config.output_bias else None)
        mlp_bias = config.mlp_bias
        gate_up_bias = torch.cat([get(f"{mlp}{p}.bias") for p in gate_up]) if mlp_bias else None
        self.register_buffer("gate_up_bias", gate_up_bias)
        self.register_buffer("down_bias", get(mlp + "down_proj.bias") if mlp_bias else None)

    def matrices(self) -> list[Weight]:
        """This layer's weight matrices as the products run them, in the order the layer
        multiplies them (a mixture of experts' shared expert's; its experts are buffers)."""
        matrices = [self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight]
        if self.moe is not None:
            matrices += [self.moe.shared_gate_up, self.moe.shared_down]
        return [w for w in matrices if w is not None]

    def weights(self) -> list[torch.Tensor]:
        """This layer's learned tensors: its matrices (as stored) in the order the layer
        multiplies them, then its norms' weights and the biases."""
        return [weight_storage(w) for w in self.matrices()] + list(self.buffers())

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weight, bias = getattr(self, name), getattr(self, name + "_bias", None)
        return normalize(x, weight, bias, c.spec.norm, c.rms_norm_eps, self.dtype)

    def _row_parallel(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``linear(x, weight, bias)`` of a row-parallel product (output projection,
        down): under tensor parallelism each rank's partial sum is all-reduced, and the
        bias added once, after."""
        if self.parallel is None:
            return linear(x, weight, bias)
        out = linear(x, weight)
        self.parallel.all_reduce(out)
        return out if bias is None else out.add_(bias)

    def _add(self, hidden: torch.Tensor, branch: torch.Tensor) -> None:
        multiplier = self.config.residual_multiplier
        hidden += branch if multiplier == 1.0 else branch * multiplier

    def _add_then_norm(self, hidden: torch.Tensor, branch: torch.Tensor, name: str) -> torch.Tensor:
        """``_add(hidden, branch)``, then norm ``name`` of the sum: one pass for a plain
        RMSNorm (:func:`~pagedllm.models.fused.add_rms_norm`), the same bits."""
        c = self.config
        if c.spec.norm == "rms" and c.residual_multiplier == 1.0:
            return add_rms_norm(hidden, branch, getattr(self, name), c.rms_norm_eps)
        self._add(hidden, branch)
        return self._norm(name, hidden)

    def _qk_normed(self, name: str, x: torch.Tensor, heads: int) -> torch.Tensor:
        """q or k ``[T, heads * D]`` through its norm, as ``[T, heads, D]``."""
        c, tokens, weight = self.config, x.shape[0], getattr(self, name)
        if c.qk_norm == "layer_head":
            return layer_norm_per_head(x.view(tokens, heads, -1), weight, c.rms_norm_eps)
        rows = x.reshape(-1, c.head_dim) if c.qk_norm == "head" else x.contiguous()
        return rms_norm(rows, weight, c.rms_norm_eps).view(tokens, heads, -1)

    def _rotated_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryTable | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``: q and k normed (if the architecture
        norms them) and rotated (if it has RoPE), all contiguous."""
        c = self.config
        full_rope = rotary is not None and c.rotary_dim == c.head_dim
        if self.q_norm is None and full_rope:
            return rotary.split_qkv(qkv, positions, c.num_heads, c.num_kv_heads)
        tokens, dim = qkv.shape[0], c.head_dim
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=1)
        if self.q_norm is not None:
            q = self._qk_normed("q_norm", q, c.num_heads)
            k = self._qk_normed("k_norm", k, c.num_kv_heads)
        q, k = q.reshape(tokens, c.num_heads, dim), k.reshape(tokens, c.num_kv_heads, dim)
        if rotary is not None:
            cos, sin = rotary.lookup(positions)
            q = apply_partial_rope(q, cos, sin, c.rotary_dim)
            k = apply_partial_rope(k, cos, sin, c.rotary_dim)
        return q.contiguous(), k.contiguous(), v.reshape(tokens, c.num_kv_heads, dim)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Update the residual stream ``hidden`` ``[T, hidden]`` in place and return it;
        with ``output_rows``, return only those rows, whose output projection and MLP
        alone are computed (attention still writes every token's K/V)."""
        c = self.config
        layout = c.norm_layout
        if layout == "post":
            normed = hidden.to(self.dtype)
        else:
            normed = self._norm("input_layernorm", hidden)
        qkv = linear(normed, self.qkv_weight, self.qkv_bias)
        if c.clip_qkv is not None:
            qkv.clamp_(-c.clip_qkv, c.clip_qkv)
        q, k, v = self._rotated_qkv(qkv, positions, rotary)
        own = metadata.for_layer(self.layer_idx)  # its KV layer group's tables
        attended = attn.forward(self.layer_idx, q, k, v, own, self.attention)
        if output_rows is not None:
            hidden, attended = hidden[output_rows], attended[output_rows]
            if layout == "parallel_shared":
                normed = normed[output_rows]
        # Parallel layouts: the MLP reads the residual stream from before attention's add.
        if layout == "parallel":
            normed = self._norm("post_attention_layernorm", hidden)
        attended = attended.reshape(hidden.shape[0], c.q_size)
        out = self._row_parallel(attended, self.o_weight, self.o_bias)
        if layout in ("sandwich", "post"):
            out = self._norm("post_attention_layernorm", out)
        if layout == "pre":
            normed = self._add_then_norm(hidden, out, "post_attention_layernorm")
        elif layout == "sandwich":
            normed = self._add_then_norm(hidden, out, "pre_feedforward_layernorm")
        else:
            self._add(hidden, out)
            if layout == "post":
                normed = hidden.to(self.dtype)
        if self.moe is not None:
            out = self.moe(normed)
        else:
            gate_up = linear(normed, self.gate_up_weight, self.gate_up_bias)
            if c.spec.gated_mlp:
                activated = gated_activation(gate_up, c.hidden_act)
            else:
                activated = activation(gate_up, c.hidden_act)
            out = self._row_parallel(activated, self.down_weight, self.down_bias)
        if layout in ("sandwich", "post"):
            out = self._norm("post_feedforward_layernorm", out)
        self._add(hidden, out)
        return hidden


class CausalDecoder(nn.Module):
    """Embedding (plus GPT-2's learned positions), ``num_layers`` decoder layers, final
    norm and the LM head, for every architecture of
    :data:`~pagedllm.models.architectures.ARCHITECTURES`.

    All weights share one dtype (float32, bfloat16, or float16 on CUDA) and one device,
    where the rotary tables live too; each source tensor is moved and converted as it is
    read, so no second copy of the whole model is ever built. Norm weights are stored as
    ``offset + weight`` (computed in float32, then converted). The LM head is the embedding
    matrix when the config ties them; then one copy is kept, in the LM head's form, and
    embedding lookups read its rows.

    With ``parallel``, the decoder holds rank ``parallel.rank``'s slice of every weight
    (:mod:`pagedllm.models.sharded_weights`): its layers run ``layer_config``, the
    rank's heads and MLP width; embedding rows and logits are those of its vocabulary
    shard (``vocab_rows``, padded), summed and gathered across the ranks. ``config``
    stays the whole model's. ``linear_kernel`` (``auto``, ``packed``, ``onednn``, ``dense``;
    see :mod:`pagedllm.cpu.kernel_choice`) picks the form of each float matrix on the CPU;
    the choice is logged once. ``expansion_budget``: bytes that expanded copies of GGUF
    block weights may take (:mod:`pagedllm.models.block_expansion`; 0: none).
    """

    def __init__(
        self,
        config: ModelConfig,
        get: WeightSource,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        linear_kernel: str = "auto",
        parallel: TensorParallelGroup | None = None,
        expansion_budget: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        # On the CPU the residual stream is float32 whatever the dtype (the layers still
        # multiply in bfloat16): with float32 logits, a bfloat16 model's logits stray from
        # float32's half as far (docs/models.md). On a GPU it keeps the model's dtype, as
        # transformers and vLLM do.
        self.residual_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.parallel = parallel
        self.layer_config = config
        self.vocab_rows = range(config.vocab_size)
        if parallel is not None:
            partition = TensorPartition(config, parallel.world_size)
            self.layer_config = partition.local_config(parallel.rank)
            shard = partition.rank_slice(parallel.rank).vocab
            self.vocab_rows = range(shard.start, shard.start + partition.vocab_shard)
            get = ShardedWeights(get, partition, parallel.rank)
        spec = config.spec

        def get_as_dtype(name: str) -> torch.Tensor | QuantizedWeight:
            weight = get(name)
            if isinstance(weight, QuantizedWeight):  # only ever loaded for the CPU
                return weight
            return weight.to(device=self.device, dtype=dtype).contiguous()

        def get_norm(name: str) -> torch.Tensor:
            weight = get(name).to(device=self.device, dtype=torch.float32) + spec.norm_offset
            return weight.to(dtype).contiguous()

        choice = KernelChoice(linear_kernel, activations=dtype, expansion_budget=expansion_budget)
        embed = get_as_dtype("model.embed_tokens.weight")
        self.layers = nn.ModuleList(
            DecoderLayer(self.layer_config, i, get_as_dtype, get_norm, choice, dtype, parallel)
            for i in range(config.num_layers)
        )
        weighted = spec.norm != "layer_plain"
        self.register_buffer("final_norm", get_norm("model.norm.weight") if weighted else None)
        bias = get_as_dtype("model.norm.bias") if spec.norm == "layer" else None
        self.register_buffer("final_norm_bias", bias)
        learned = spec.positions == "learned"
        positions = get_as_dtype("model.embed_positions.weight") if learned else None
        self.register_buffer("embed_positions", positions)
        if config.tie_word_embeddings:
            self.lm_head = prepare_weight(embed, choice, rows_read=True)
            self.embed_tokens: Weight = self.lm_head
        else:
            self.lm_head = prepare_weight(get_as_dtype("lm_head.weight"), choice)
            self.embed_tokens = embed
        for summary in (choice.summary(), choice.expansion_summary()):
            if summary is not None:
                logger.info(summary)
        scale = config.hidden_size**0.5 if spec.embedding_scaled else config.embedding_multiplier
        # As transformers: a float32 scalar rounded to the model dtype, times each row.
        self.embedding_scale = None if scale == 1.0 else torch.tensor(scale).to(dtype).item()
        self.rotary = RotaryTable(config, dtype, self.device) if not learned else None
        self.local_rotary = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_scaling=config.local_rope_scaling
            )
            self.local_rotary = RotaryTable(local, dtype, self.device)

    def weights(self) -> list[torch.Tensor]:
        """Every learned tensor the forward pass reads, each once (a tied embedding once,
        packed weights as their padded panels): matrices, norm weights and biases, in the
        order a step reads them: layer by layer, then the final norm and the LM head; the
        embedding (of which a step reads only its tokens' rows), then the expanded copies
        of block weights (which only calls of many rows read), last."""
        tensors = [t for layer in self.layers for t in layer.weights()]
        tensors += self.buffers(recurse=False)
        tensors += [weight_storage(w) for w in (self.lm_head, self.embed_tokens)]
        matrices = [w for layer in self.layers for w in layer.matrices()] + [self.lm_head]
        tensors += [t for w in matrices for t in expanded_storage(w)]
        return list({id(t): t for t in tensors}.values())

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a forward pass can be captured in a CUDA graph: not when a layer reads
        a device value on the host (mixture-of-experts routing counts each expert's
        tokens to batch them)."""
        return all(layer.moe is None for layer in self.layers)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding rows ``[T, hidden_size]`` of ``input_ids`` ``[T]``, scaled as the
        architecture scales them, plus the position embeddings of ``positions`` ``[T]``
        for an architecture that learned them (GPT-2)."""
        if self.parallel is None:
            rows = self._embedding_rows(input_ids)
        else:  # each id's row lives on one rank; the others add zeros
            local = input_ids - self.vocab_rows.start
            outside = (local < 0) | (local >= len(self.vocab_rows))
            rows = self._embedding_rows(local.masked_fill(outside, 0)).contiguous()
            rows[outside] = 0
            self.parallel.all_reduce(rows)
        if self.embed_positions is not None:
            if positions is None:
                raise ValueError("this architecture's embeddings need the token positions")
            rows = rows + F.embedding(positions, self.embed_positions)
        return rows if self.embedding_scale is None else rows * self.embedding_scale

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, BlockWeight | ExpandedBlocks):
            return self.embed_tokens.rows(ids).to(self.dtype)
        if isinstance(self.embed_tokens, PackedWeight):
            return self.embed_tokens.rows(ids)
        return F.embedding(ids, self.embed_tokens)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden_size]`` for tokens ``input_ids`` ``[T]``,
        or only rows ``output_rows`` of them (the last layer then skips the rest).

        ``positions`` ``[T]`` holds each token's 0-based index within its sequence. With
        ``layer_stack`` (built over ``attn``), the layers run as its one C++ call.
        """
        hidden = self.embed(input_ids, positions).to(self.residual_dtype)
        if layer_stack is not None:
            hidden = layer_stack.forward(hidden, positions, metadata, output_rows)
        else:
            last = len(self.layers) - 1
            for index, layer in enumerate(self.layers):
                rows = output_rows if index == last else None
                rotary = self.local_rotary if layer.local_rope else self.rotary
                hidden = layer(hidden, positions, rotary, attn, metadata, rows)
        c = self.config
        return normalize(
            hidden, self.final_norm, self.final_norm_bias, c.spec.norm, c.rms_norm_eps, self.dtype
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[N, vocab_size]`` for the ``N`` hidden rows to be sampled,
        divided by ``logits_divisor`` and soft-capped as the config says. Under tensor
        parallelism every rank calls it with the same ``N``; rank 0 gets the gathered
        logits, the others ``None``."""
        c = self.config
        # Unrounded where the CPU kernels sum in float32 anyway: bfloat16 logits of ~20
        # are 0.125 apart, which turns near ties into exact ones.
        logits = linear(hidden, self.lm_head, float_output=True)
        if self.parallel is not None and len(hidden):
            logits = self.parallel.gather_columns(logits)
            if logits is None:
                return None
        return self.finish_logits(logits[:, : c.vocab_size])

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 products made logits: divided by ``logits_divisor`` and
        soft-capped as the config says (elementwise, any shape)."""
        c = self.config
        if c.logits_divisor != 1.0:
            logits = logits / c.logits_divisor
        if c.final_logit_softcap:
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits
