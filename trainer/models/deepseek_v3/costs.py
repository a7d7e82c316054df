"""DeepSeek-V3's FLOPs and memory terms: multi-head latent attention (the latents and the rotary
part of the key computed whole on every tp rank; the heads split), a SwiGLU feed-forward in the
first blocks and an MoE layer in the others."""

from __future__ import annotations

from trainer.models.costs import (
    FP32,
    Costs,
    Flops,
    Shapes,
    matmuls_kept,
    moe_saved,
    moe_slots,
    scores_flops,
    swiglu_saved,
    ulysses_elements,
    ulysses_sent,
)
from trainer.models.deepseek_v3.model import DeepseekV3Config


def attention_weights(cfg: DeepseekV3Config) -> int:
    """The weights of one block's MLA projections."""
    heads, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (cfg.dim * heads * qk if cfg.q_lora_rank is None
         else cfg.q_lora_rank * (cfg.dim + heads * qk))
    kv = (cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
          + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    return q + kv + heads * cfg.v_head_dim * cfg.dim


class DeepseekV3Costs(Costs):
    def flops(self, cfg: DeepseekV3Config, seq_len: int) -> Flops:
        n_moe = len(cfg.moe_layers())
        attention = cfg.n_layers * attention_weights(cfg)
        dense = attention + (cfg.n_layers - n_moe) * 3 * cfg.dim * cfg.dense_ffn_dim
        # shared experts: plain linear layers
        dense += n_moe * 3 * cfg.dim * cfg.ffn_dim * cfg.n_shared_experts
        routed = n_moe * (3 * cfg.dim * cfg.ffn_dim * cfg.top_k + cfg.dim * cfg.n_experts)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return Flops(blocks=6 * (dense + routed),
                     attention=cfg.n_layers * scores_flops(cfg.n_heads, qk, cfg.v_head_dim,
                                                           seq_len),
                     head=6 * cfg.dim * cfg.vocab_size, float8=6 * dense)

    def float8_params(self, cfg: DeepseekV3Config) -> float:
        """Over all blocks: MLA, the dense feed-forwards, the shared experts; not the routed
        experts' grouped GEMMs or the router."""
        n_moe = len(cfg.moe_layers())
        ffn = 3 * cfg.dim * cfg.ffn_dim
        dense = (cfg.n_layers * attention_weights(cfg)
                 + (cfg.n_layers - n_moe) * 3 * cfg.dim * cfg.dense_ffn_dim)
        dense += n_moe * ffn * cfg.n_shared_experts
        return dense / (dense + n_moe * (cfg.n_experts * ffn + cfg.dim * cfg.n_experts))

    def activation_bytes(self, s: Shapes, layer: int) -> float:
        m = s.model
        elements, fp32 = self._attention_saved(s)
        if layer < m.n_dense_layers:
            elements += swiglu_saved(s, m.dense_ffn_dim)
        else:
            moe, moe_fp32 = moe_saved(s, m.n_experts, m.top_k, m.ffn_dim,
                                      m.n_shared_experts * m.ffn_dim)
            elements, fp32 = elements + moe, fp32 + moe_fp32
        return elements * s.act_bytes + fp32 * FP32

    def selective_bytes(self, s: Shapes, layer: int, policy: str) -> float:
        """The block's input, its matmuls' outputs as the policy keeps them (in forward order),
        attention's output and log-sum-exp, Ulysses' all-to-alls, the experts' grouped matmuls
        (always kept) and the tensor-parallel reductions into the stream."""
        m, t, tp = s.model, s.tokens, s.tp
        heads, qk = m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ([t * heads * qk // tp] if m.q_lora_rank is None
             else [t * m.q_lora_rank, t * heads * qk // tp])
        matmuls = [*q, t * (m.kv_lora_rank + m.qk_rope_head_dim),
                   t * heads * (m.qk_nope_head_dim + m.v_head_dim) // tp, t * m.dim]
        # a dense feed-forward, or the shared experts: one more reduction
        experts, feed_forwards = 0.0, 1
        if layer < m.n_dense_layers:
            matmuls += [t * m.dense_ffn_dim // tp] * 2 + [t * m.dim]
        else:
            width, feed_forwards = m.n_shared_experts * m.ffn_dim, int(m.n_shared_experts > 0)
            # Our MoE layer runs the shared experts (their input gathered) before the router.
            matmuls += (([t * width // tp] * 2 + [t * m.dim]) * feed_forwards
                        + [s.stream_tokens * m.n_experts])
            # see costs.moe_kept
            per_slot = 2 * m.ffn_dim + m.dim + (3 * m.dim if s.experts_apart else 0)
            experts = moe_slots(s, m.top_k) * s.expert_load * per_slot
            experts += t * m.dim * feed_forwards if tp > 1 else 0
        reduced = (1 + feed_forwards) * s.stream_tokens * m.dim if tp > 1 else 0
        elements = (s.stream_tokens * m.dim + matmuls_kept(matmuls, policy)
                    + t * heads * m.v_head_dim // tp
                    + ulysses_elements(s, heads, heads, qk, m.v_head_dim))
        return (elements + experts + reduced) * s.act_bytes + t * heads // tp * FP32

    def context_bytes(self, s: Shapes) -> float:
        """Keys and values (padded to the keys' width) of the rank's tokens and heads."""
        m = s.model
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return 2 * s.tokens * m.n_heads * qk // s.tp * s.act_bytes

    def ulysses_bytes(self, s: Shapes) -> float:
        m = s.model
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return ulysses_sent(s, m.n_heads, m.n_heads, qk, m.v_head_dim)

    def expert_bytes(self, s: Shapes) -> float:
        return s.tokens * s.model.top_k * s.model.dim * s.act_bytes

    @staticmethod
    def _attention_saved(s: Shapes) -> tuple[float, float]:
        """(elements in the compute dtype, fp32 elements) the norms and MLA of a block save."""
        m, t, tp = s.model, s.tokens, s.tp
        heads, qk, rope = m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_rope_head_dim
        elements = 2 * s.stream_tokens * m.dim  # the two norms' inputs
        elements += 2 * t * m.dim  # the (gathered) inputs of the attention and of the feed-forward
        fp32 = 2 * s.stream_tokens  # their scales
        if m.q_lora_rank is not None:  # the query latent, before and after its norm
            elements, fp32 = elements + 2 * t * m.q_lora_rank, fp32 + t
        # The key/value latent before its norm (a view of the
        # projection's output, rotary key and all) and after.
        elements += t * (m.kv_lora_rank + rope) + t * m.kv_lora_rank
        fp32 += t
        elements += t * heads * (2 * qk + 2 * m.v_head_dim) // tp  # q, k, v and attention's output
        if s.cp_ulysses > 1:  # the output's copy back in sequence slices
            elements += t * heads * m.v_head_dim // tp
        if s.cp_ring > 1 and s.cp_method == "allgather":  # the gathered keys and (padded) values
            elements += 2 * t * heads * qk // tp * s.cp_ring
        # Attention's log-sum-exp; the rotary cos and sin.
        return elements, fp32 + t * heads // tp + 2 * t * rope
