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


def attention_documents_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, offset: int
                              ) -> torch.Tensor:
    """The attention-level form of :func:`documents_alone`: each document alone through plain causal SDPA.

    ``q [1, Hq, L, D]`` at rows ``[offset, offset+L)`` of ``doc [S]`` (document ids), ``k``/``v [1, Hkv, S, D]``.
    Returns ``[1, Hq, L, D]`` for the local rows.
    """
    out = torch.zeros_like(q)
    rows = torch.arange(offset, offset + q.shape[2])
    for d in doc.unique().tolist():
        keys = torch.nonzero(doc == d).flatten()
        local = torch.nonzero(doc[rows] == d).flatten()
        if not local.numel():
            continue
        n = local.numel()
        kd = k[:, :, keys[0]: offset + int(local[-1]) + 1]
        vd = v[:, :, keys[0]: offset + int(local[-1]) + 1]
        qd = q[:, :, local]
        # bottom-right causal: the n local queries are the last n of the document's keys so far
        prefix = kd.shape[2] - n
        mask = torch.arange(kd.shape[2])[None, :] <= (prefix + torch.arange(n))[:, None]
        out[:, :, local] = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
    return out


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


class Alone:
    """What :func:`documents_alone` measured. Unpacks as ``logits, grads`` (its first callers' form).

    ``logits [T, V]``: every document's logits in ``docs`` order (float32, or float32 copies under autocast);
    ``grads``: ``{parameter name: grad}`` of the loss (empty with ``backward=False``); ``loss``: that loss.
    """

    def __init__(self, logits: torch.Tensor, grads: dict[str, torch.Tensor], loss: float) -> None:
        self.logits, self.grads, self.loss = logits, grads, loss

    def __iter__(self):
        return iter((self.logits, self.grads))

    def split(self, docs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The logits per document, ``[len(doc), V]`` each."""
        return list(torch.split(self.logits, [len(d) for d in docs]))


def documents_alone(kind: str, docs: Sequence[torch.Tensor], model: torch.nn.Module | None = None, *,
                    attn_implementation: str = "sdpa", labels: Sequence[torch.Tensor] | None = None,
                    first_positions: Sequence[int] | None = None, autocast: torch.dtype | None = None,
                    reduction: str = "mean", backward: bool = True,
                    inputs: Sequence[dict] | None = None) -> Alone:
    """The reference of every packed test: each document alone through the unmodified (stock ``"sdpa"``) model.

    Runs ``docs`` (1-D token tensors) one by one through ``model`` (default: the tiny model of ``kind`` with
    ``attn_implementation``), each at positions from ``first_positions[i]`` (default 0), under CPU autocast to
    ``autocast`` if given. Loss: next-token cross entropy against ``labels`` (default the documents; -100 is
    ignored), in float64, summed over documents and divided by the predicted-token count (``reduction="mean"``)
    or not (``"sum"``); backpropagated unless ``backward=False`` (then no autograd at all). ``inputs``: per document,
    further model inputs (an image-text model's ``pixel_values``, ``token_type_ids``, ``position_ids``).
    """
    model = model if model is not None else tiny_model(kind, attn_implementation=attn_implementation)
    labels = docs if labels is None else labels
    starts = [None] * len(docs) if first_positions is None else first_positions
    logits, loss, count = [], 0.0, 0
    with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
        for i, (doc, target, start) in enumerate(zip(docs, labels, starts)):
            # Positions only when asked: some architectures take none, and the default is 0, 1, ...
            positions = {} if start is None else {"position_ids": torch.arange(start, start + len(doc))[None]}
            positions.update(inputs[i] if inputs is not None else {})
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(input_ids=doc[None], use_cache=False, **positions).logits[0].float()
            logits.append(out)
            loss = loss + torch.nn.functional.cross_entropy(out[:-1].double(), target[1:], ignore_index=-100,
                                                            reduction="sum")
            count += int((target[1:] != -100).sum())
        if reduction == "mean":
            loss = loss / count
        elif reduction != "sum":
            raise ValueError(f"reduction={reduction!r}: 'mean' or 'sum'")
    grads = {}
    if backward:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return Alone(torch.cat(logits).detach(), grads, float(loss.detach()) if torch.is_tensor(loss) else loss)


def per_document_sgd_step(docs: Sequence[torch.Tensor]) -> tuple[dict, dict, float]:
    """One SGD step (lr 1) of one process on ``docs`` (1-D token tensors), each run alone through the
    stock ``"sdpa"`` tiny Llama, loss = mean next-token loss over all documents.

    Returns (parameters before, parameters after, loss).
    """
    model = tiny_model("llama", attn_implementation="sdpa")
    loss = documents_alone("llama", docs, model).loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return before, {n: p.detach().clone() for n, p in model.named_parameters()}, loss
