"""The Triton search for top-p's edge (``triton_top_p.nucleus_edge``) against the sort's
(``sampler._nucleus_edge``): the same kept tokens in every row, over peaked, flat,
tied-band, top-k-masked and one-token rows, top-p from 1e-300 to 1 and none (inf), with
one program a row or several. On CPU the kernels run in Triton's interpreter, in a child
process (tests/triton_interpreter.py); the same cases on CUDA under the ``cuda`` mark."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.triton_interpreter import print_case_results, run_interpreted

VOCAB = 1500  # six blocks of 256: a partial last block


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scales = [0.5, 2.0, 6.0, 12.0, 1.0, 3.0, 0.0, 4.0, 8.0, 2.5, 1.5, 5.0]
    logits = torch.randn(len(scales), VOCAB, generator=g) * torch.tensor(scales)[:, None]
    logits[4, 100:400] = 2.0  # a band of 300 tied tokens, the nucleus's edge among them
    logits[7, 50:] = float("-inf")  # top-k left 50 tokens: zeros after the softmax
    logits[9, 1:] = float("-inf")  # one token left
    top_p = [0.9, 0.5, 0.99, 1e-300, 0.6, 1.0, 0.3, 0.95, float("inf"), 0.7, 0.999, 0.1]
    return logits, torch.tensor(top_p, dtype=torch.float64)


def run_case(seed: int, splits: int | None, device: str) -> dict:
    from vllm.v1.sample import sampler, triton_top_p

    logits, top_p = _logits(seed)
    logits, top_p = logits.to(device), top_p.to(device)
    probs = logits.softmax(-1)
    edge = triton_top_p.nucleus_edge(probs, top_p, splits)
    by_sort, _ = sampler._nucleus_edge(probs.sort(dim=-1, descending=True).values, top_p)
    kept, kept_by_sort = probs >= edge[:, None], probs >= by_sort[:, None]
    # The sampler's own way in: apply_top_p with the method named, the same -inf mask.
    masked = {m: sampler.apply_top_p(logits, top_p, method=m) for m in ("sort", "triton")}
    return {
        "rows_differing": (kept != kept_by_sort).any(-1).nonzero()[:, 0].tolist(),
        "kept": kept.sum(-1).tolist(),
        "kept_by_sort": kept_by_sort.sum(-1).tolist(),
        "apply_top_p_equal": torch.equal(masked["sort"], masked["triton"]),
    }


CASES = {f"seed{seed}-splits{splits}": (seed, splits) for seed in (0, 1) for splits in (1, 3, None)}


def check(result: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["rows_differing"] == [], result
    assert result["apply_top_p_equal"]
    kept = result["kept"]
    assert kept[3] == 1 and kept[9] == 1  # 1e-300: the top token alone; one token left
    assert kept[8] == VOCAB  # no top-p: every token
    assert kept[6] == VOCAB  # scale 0: all tied, so all kept


def interpreter_main() -> None:
    """The child: every case's result as one JSON line (TRITON_INTERPRET=1 set)."""
    from vllm.v1.sample import triton_top_p

    print_case_results(
        type(triton_top_p._top_p_pass).__name__,
        CASES,
        lambda case_id: run_case(*CASES[case_id], "cpu"),
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    results = run_interpreted(__name__, timeout=300)
    assert results.pop("interpreted") == "InterpretedFunction"
    return results


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_edge_keeps_the_sorts_tokens(interpreted, case_id):
    check(interpreted[case_id])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("case_id", list(CASES))
def test_edge_keeps_the_sorts_tokens_on_cuda(case_id):
    check(run_case(*CASES[case_id], "cuda"))


def test_refuses_what_it_cannot_search():
    pytest.importorskip("triton")
    from vllm.v1.sample import triton_top_p

    top_p = torch.tensor([0.9], dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        triton_top_p.nucleus_edge(torch.zeros(1, 8, dtype=torch.float64), top_p)
    with pytest.raises(ValueError, match="rows, vocab"):
        triton_top_p.nucleus_edge(torch.zeros(8), top_p)
    empty = triton_top_p.nucleus_edge(torch.zeros(0, 8), top_p[:0])
    assert empty.shape == (0,)
