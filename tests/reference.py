"""Independent references for tests: a float64 brute-force dense attention and tiny local models.

Nothing here imports the package under test except to register the attention name, so references
cannot inherit its bugs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dense_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, doc_ids: torch.Tensor | Sequence[int],
                    row_offset: int = 0, *, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 block-diagonal causal attention by brute force.

    ``query [B,Hq,L,D]`` at global positions ``[row_offset, row_offset+L)``, ``key [B,Hkv,S,D]`` and
    ``value [B,Hkv,S,Dv]`` at ``[0, S)``, ``doc_ids [S]`` or ``[B,S]`` (0 = padding, a document =
    maximal run of one id). ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before
    masking (gemma2). ``sinks [Hq]``: one extra logit per head in every row's softmax, whose
    probability is dropped (gpt-oss ``s_aux``). Padding query rows (and rows that see nothing) are 0.
    Returns ``[B,Hq,L,Dv]`` float64 (differentiable w.r.t. float64 inputs, ``sinks`` included).
    """
    batch, num_q_heads, local_len, head_dim = query.shape
    full_len = key.shape[2]
    doc = torch.as_tensor(doc_ids).to(torch.int64)
    if doc.dim() == 1:
        doc = doc.expand(batch, -1)
    run = torch.zeros_like(doc)
    run[:, 1:] = (doc[:, 1:] != doc[:, :-1]).to(torch.int64)
    run = run.cumsum(1)
    q_pos = torch.arange(row_offset, row_offset + local_len)
    k_pos = torch.arange(full_len)
    allowed = ((run[:, q_pos][:, :, None] == run[:, None, :])
               & (doc[:, q_pos][:, :, None] != 0) & (doc[:, None, :] != 0)
               & (k_pos[None, None, :] <= q_pos[None, :, None]))
    if window is not None:
        allowed &= k_pos[None, None, :] > q_pos[None, :, None] - window
    groups = num_q_heads // key.shape[1]
    q64 = query.double()
    k64 = key.double().repeat_interleave(groups, dim=1)
    v64 = value.double().repeat_interleave(groups, dim=1)
    scores = q64 @ k64.transpose(-1, -2) * (head_dim ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().view(1, -1, 1, 1).expand(batch, -1, local_len, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v64


TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def tiny_model(kind: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A tiny randomly initialised causal LM built locally (no downloads), fp32, eval mode."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                  dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=6)),
    }
    config_cls, model_cls, extra = classes[kind]
    config = config_cls(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def random_documents(lengths: Sequence[int], seed: int = 7, vocab: int = 97) -> list[torch.Tensor]:
    """1-D token tensors of the given lengths (ids in ``[1, vocab)``; 0 is padding)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def documents_alone(kind: str, docs: Sequence[torch.Tensor], model: torch.nn.Module | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference of every packed test: each document alone through the unmodified (stock ``"sdpa"``) model.

    Runs ``docs`` (1-D token tensors) one by one through ``model`` (default: the tiny model of ``kind``) and
    backpropagates the mean next-token loss over all documents. Returns ``(logits [T, V]`` in row order,
    ``{parameter name: grad})``.
    """
    model = model if model is not None else tiny_model(kind, attn_implementation="sdpa")
    count = sum(len(d) - 1 for d in docs)
    logits = [model(d[None], use_cache=False).logits[0] for d in docs]
    loss = sum(torch.nn.functional.cross_entropy(lg[:-1], d[1:], reduction="sum") for lg, d in zip(logits, docs))
    (loss / count).backward()
    return torch.cat(logits).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def per_document_sgd_step(docs: Sequence[torch.Tensor]) -> tuple[dict, dict, float]:
    """One SGD step (lr 1) of one process on ``docs`` (1-D token tensors), each run alone through the
    stock ``"sdpa"`` tiny Llama, loss = mean next-token loss over all documents.

    Returns (parameters before, parameters after, loss).
    """
    model = tiny_model("llama", attn_implementation="sdpa")
    count = sum(len(d) - 1 for d in docs)
    loss = sum(torch.nn.functional.cross_entropy(model(d[None], use_cache=False).logits[0, :-1], d[1:],
                                                 reduction="sum") for d in docs) / count
    loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return before, {n: p.detach().clone() for n, p in model.named_parameters()}, loss.item()
