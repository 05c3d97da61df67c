"""vLLM's sampling parameters as pure functions (elastic.core.sampling) and the token they choose."""

from __future__ import annotations

import torch

from elastic.core.protocol import RequestSpec
from elastic.core.sampling import adjusted_logits, filtered_probs, neutral, sample
from elastic.worker.batch import choose


def spec(**fields) -> RequestSpec:
    return RequestSpec(request_id="r", prompt=(1, 2), max_tokens=8, **fields)


LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def test_neutral_parameters_leave_greedy_the_models_argmax():
    s = spec(stop_token_ids=(3,), min_tokens=0)
    assert neutral(s, 0) and choose(s, LOGITS, 0)[0] == 3
    assert not neutral(spec(stop_token_ids=(3,), min_tokens=2), 1)
    assert not neutral(spec(repetition_penalty=1.1), 0) and not neutral(spec(logit_bias=((0, 1.0),)), 0)


def test_penalties_and_bias_change_the_logits_of_the_tokens_they_name_only():
    out = adjusted_logits(spec(repetition_penalty=2.0), LOGITS, generated=[4])
    # prompt tokens 1, 2 and output token 4: positive logits halved, negative doubled
    assert out.tolist() == [2.0, -2.0, 0.25, 3.0, -4.0, 1.0]
    out = adjusted_logits(spec(frequency_penalty=0.5, presence_penalty=1.0), LOGITS, generated=[5, 5, 0])
    assert out.tolist() == [0.5, -1.0, 0.5, 3.0, -2.0, -1.0]  # 5 seen twice: 1 - 2*0.5 - 1; 0 once: 2 - 0.5 - 1
    out = adjusted_logits(spec(logit_bias=((1, 10.0),)), LOGITS, generated=[])
    assert out[1] == 9.0 and choose(spec(logit_bias=((1, 10.0),)), LOGITS, 0)[0] == 1


def test_min_tokens_masks_the_stop_tokens_until_reached():
    s = spec(stop_token_ids=(3,), min_tokens=2)
    assert choose(s, LOGITS, 0, [])[0] == 0 and choose(s, LOGITS, 1, [0])[0] == 0  # 3 masked: the next best
    assert choose(s, LOGITS, 2, [0, 0])[0] == 3


def test_top_k_top_p_and_min_p_keep_the_tokens_they_should():
    kept = lambda **f: set(torch.nonzero(filtered_probs(spec(temperature=1.0, **f), LOGITS)).flatten().tolist())  # noqa: E731
    assert kept() == set(range(6))
    assert kept(top_k=2) == {3, 0}
    probs = torch.softmax(LOGITS.double(), -1)
    assert probs[3] < 0.7 < probs[3] + probs[0]
    assert kept(top_p=0.7) == {3, 0}  # the smallest set whose mass reaches 0.7
    assert kept(min_p=0.3) == {3, 0}  # p >= 0.3 * p(3): e^-1 = 0.37 of the top for token 0, 0.14 for token 5
    assert abs(float(filtered_probs(spec(temperature=1.0, top_k=2), LOGITS).sum()) - 1.0) < 1e-12


def test_a_sample_repeats_for_a_seed_and_position_and_stays_inside_the_filter():
    s = spec(temperature=1.0, seed=7, top_k=3)
    draws = [sample(s, LOGITS.double(), position) for position in range(40)]
    assert draws == [sample(s, LOGITS.double(), position) for position in range(40)]
    assert set(draws) <= {3, 0, 5} and len(set(draws)) > 1
    other = [sample(spec(temperature=1.0, seed=8, top_k=3), LOGITS.double(), p) for p in range(40)]
    assert other != draws
