"""Policy losses of the GRPO family against small examples worked out by hand.

The shared batch: 2 sequences x 4 tokens, the last token of sequence 1 masked out (7 tokens count).
Log-ratios d = logp - behavior, ratios r = e^d, against GRPO's clip range [0.8, 1.2]:

    seq 0, A = +1: d = 0.4   -0.1  0.22  0.1       r = 1.492 0.905 1.246 1.105
                       clip   -    clip   -        (DAPO's upper 1.28 leaves 1.246 unclipped)
    seq 1, A = -2: d = -0.5   0.3  0.05  masked    r = 0.607 1.350 1.051
                       clip   -     -              (r > 1.2 with A < 0: the min keeps r*A)

Per-token loss = -min(r*A, clip(r)*A), e.g. -(1.2 * 1) for a clipped token of sequence 0.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from relayrl.coordinator.algorithms.token_advantages import kl_penalty
from relayrl.learner import losses
from relayrl.learner.config import K3_BOUND, LossConfig
from relayrl.learner.losses import (
    LossInputs,
    Totals,
    after_masked_span,
    kl_estimate,
    policy_sums,
)
from relayrl.learner.trainer import token_means


def _read(metrics: dict) -> dict[str, float]:
    """The loss's metric sums, which stay on the device (0-dim, detached: the trainer adds them
    up there and reads the step's once), as numbers."""
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in metrics.values()), metrics
    return {n: float(v) for n, v in metrics.items()}


def policy_loss(*args, **kwargs):
    loss, metrics = losses.policy_loss(*args, **kwargs)
    return loss, _read(metrics)


def value_loss(*args, **kwargs):
    loss, metrics = losses.value_loss(*args, **kwargs)
    return loss, _read(metrics)


approx = partial(pytest.approx, rel=1e-9)
e = math.exp

LP = [[-0.6, -2.1, -0.28, -1.4], [-0.8, -2.2, -1.15, 1.2]]
BEH = [[-1.0, -2.0, -0.5, -1.5], [-0.3, -2.5, -1.2, -0.8]]
REF = [[-0.7, -1.9, -0.28, -1.7], [-1.3, -2.1, -1.35, -50.0]]  # logp - ref = 0.1 -0.2 0 0.3 | 0.5 -0.1 0.2
ADV = [1.0, -2.0]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]
TOTALS = Totals(tokens=7, sequences=2, max_tokens=5)

# GRPO per-token losses (clip 0.2/0.2), by the table above.
G0 = [-1.2, -e(-0.1), -1.2, -e(0.1)]  # A=+1: clipped, r, clipped, r
G1 = [-(0.8 * -2), -(e(0.3) * -2), -(e(0.05) * -2)]  # A=-2: clipped at 0.8, r, r


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def batch(lp=LP, beh=BEH, ref=REF, adv=ADV, mask=MASK) -> LossInputs:
    return LossInputs(t64(lp).requires_grad_(), t64(beh), t64(adv), torch.tensor(mask), t64(ref))


def loss_and_grad(inp: LossInputs, cfg: LossConfig, totals: Totals = TOTALS):
    loss, metrics = policy_loss(inp, cfg, totals)
    loss.backward()
    return loss.item(), inp.logprobs.grad.tolist(), metrics


def test_grpo_sequence_aggregation():
    loss, grad, metrics = loss_and_grad(batch(), LossConfig())
    # Mean over each sequence's 4 and 3 tokens, then / 2 sequences.
    assert loss == approx((sum(G0) / 4 + sum(G1) / 3) / 2)
    # d(-r*A)/dlogp = -r*A on unclipped tokens, 0 on clipped ones; / (length * sequences).
    assert grad[0] == approx([0.0, -e(-0.1) / 8, 0.0, -e(0.1) / 8])
    assert grad[1] == approx([0.0, 2 * e(0.3) / 6, 2 * e(0.05) / 6, 0.0])
    # |d| over the 7 counted tokens: 0.82 + 0.85; no masked span is followed by a counted token.
    assert metrics == approx(
        {
            "clipped": 3.0,
            "kl": 0.0,
            "tis_weight": 7.0,
            "logprob_abs_diff": 1.67,
            "after_env_abs_diff": 0.0,
            "after_env_weight": 0.0,
        }
    )


def test_grpo_token_aggregation():
    loss, grad, _ = loss_and_grad(batch(), LossConfig(aggregation="token"))
    assert loss == approx((sum(G0) + sum(G1)) / 7)
    assert grad[1] == approx([0.0, 2 * e(0.3) / 7, 2 * e(0.05) / 7, 0.0])


def test_drgrpo_divides_the_token_sum_by_sequences_times_max_tokens():
    loss, grad, _ = loss_and_grad(batch(), LossConfig(kind="drgrpo"))
    assert loss == approx((sum(G0) + sum(G1)) / (2 * 5))
    assert grad[0] == approx([0.0, -e(-0.1) / 10, 0.0, -e(0.1) / 10])


def test_dapo_clips_asymmetrically_and_averages_per_token():
    d0 = [-1.28, -e(-0.1), -e(0.22), -e(0.1)]  # 1.492 clips at 1.28; 1.246 < 1.28 now unclipped
    for cfg in (
        LossConfig(kind="dapo", clip_high=0.28),
        LossConfig(kind="dapo", clip_high=0.28, aggregation="token"),
    ):
        loss, _, metrics = loss_and_grad(batch(), cfg)
        assert loss == approx((sum(d0) + sum(G1)) / 7)
        assert metrics["clipped"] == 2.0  # (0, 0) high and (1, 0) low


def test_dapo_rejects_sequence_aggregation():
    with pytest.raises(ValidationError, match="dapo averages per token"):
        LossConfig(kind="dapo", aggregation="sequence")


@pytest.mark.parametrize(
    "estimator, kl",
    [("k1", lambda x: x), ("k3", lambda x: e(-x) + x - 1)],  # x = log(pi/ref); k3 = ref/pi - log(ref/pi) - 1
)
def test_kl_penalty_is_added_per_token_before_aggregation(estimator, kl):
    k0 = [kl(x) for x in (0.1, -0.2, 0.0, 0.3)]
    k1 = [kl(x) for x in (0.5, -0.1, 0.2)]
    loss, _, metrics = loss_and_grad(batch(), LossConfig(kl_coef=0.1, kl_estimator=estimator))
    assert loss == approx(((sum(G0) + 0.1 * sum(k0)) / 4 + (sum(G1) + 0.1 * sum(k1)) / 3) / 2)
    assert metrics["kl"] == approx(sum(k0) + sum(k1))
    if estimator == "k1":
        assert metrics["kl"] == approx(0.8)


def test_kl_without_reference_logprobs_raises():
    inp = batch()
    inp.ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(inp, LossConfig(kl_coef=0.1), TOTALS)


@pytest.mark.parametrize("aggregation, norm0, norm1", [("sequence", 4 * 2, 3 * 2), ("token", 7, 7)])
def test_tis_weights_each_token_by_the_capped_behavior_ratio(aggregation, norm0, norm1):
    # w = min(r, 1.3); the PPO ratio is pi / sg(pi) = 1, so clipping never acts and loss = -w*A.
    w0 = [1.3, e(-0.1), e(0.22), e(0.1)]  # 1.492 capped
    w1 = [e(-0.5), 1.3, e(0.05)]  # 1.350 capped
    loss, grad, metrics = loss_and_grad(batch(), LossConfig(tis_cap=1.3, aggregation=aggregation))
    assert loss == approx(sum(-w * 1 for w in w0) / norm0 + sum(-w * -2 for w in w1) / norm1)
    # d/dlogp of -(pi/sg(pi)) * w * A = -w * A, over the token's normaliser.
    assert grad[0] == approx([-w / norm0 for w in w0])
    assert grad[1] == approx([2 * w / norm1 for w in w1] + [0.0])
    assert metrics["clipped"] == 0.0
    assert metrics["tis_weight"] == approx(sum(w0) + sum(w1))


def test_clipped_counts_exactly_the_tokens_the_clip_silences():
    # seq 0, A=+1: r = e^0.5 > 1.2 (counted), e^-0.5 < 0.8 but A > 0 (not), e^0.5 masked (not)
    # seq 1, A=-1: r = e^-0.5 < 0.8 (counted), e^0.5 > 1.2 but A < 0 (not), e^-0.5 masked (not)
    inp = batch(
        lp=[[0.5, -0.5, 0.5], [-0.5, 0.5, -0.5]],
        beh=[[0.0] * 3] * 2,
        ref=[[0.0] * 3] * 2,
        adv=[1.0, -1.0],
        mask=[[1, 1, 0], [1, 1, 0]],
    )
    _, grad, metrics = loss_and_grad(inp, LossConfig(), Totals(tokens=4, sequences=2))
    assert metrics["clipped"] == 2.0
    # The counted tokens are the ones whose gradient the clip removed.
    assert grad[0][0] == 0.0 and grad[1][0] == 0.0
    assert grad[0][1] == approx(-e(-0.5) / 4) and grad[1][1] == approx(e(0.5) / 4)


def test_sft_is_the_mean_negative_logprob_over_tokens():
    loss, grad, metrics = loss_and_grad(batch(), LossConfig(kind="sft"))
    assert loss == approx(-(-0.6 - 2.1 - 0.28 - 1.4 - 0.8 - 2.2 - 1.15) / 7)  # 8.53 / 7
    assert grad[0] == approx([-1 / 7] * 4) and grad[1] == approx([-1 / 7] * 3 + [0.0])
    assert metrics == {"clipped": 0.0, "kl": 0.0, "tis_weight": 7.0}


CONFIGS = {
    "grpo-sequence": LossConfig(),
    "grpo-token": LossConfig(aggregation="token"),
    "drgrpo": LossConfig(kind="drgrpo"),
    "dapo": LossConfig(kind="dapo", clip_high=0.28),
    "tis-kl": LossConfig(tis_cap=1.3, kl_coef=0.1, kl_estimator="k3"),
}


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_micro_batch_losses_sum_to_the_full_batch_loss(cfg):
    whole = batch()
    full, _ = policy_loss(whole, cfg, TOTALS)
    full.backward()
    full_grad = whole.logprobs.grad.clone()

    # Same leaf, split into sequence 0 and sequence 1 (the latter trimmed to its 3 real tokens).
    split = batch()
    lp, beh, adv, mask, ref = (
        split.logprobs,
        split.behavior_logprobs,
        split.advantages,
        split.mask,
        split.ref_logprobs,
    )
    parts = [
        LossInputs(lp[:1], beh[:1], adv[:1], mask[:1], ref[:1]),
        LossInputs(lp[1:, :3], beh[1:, :3], adv[1:], mask[1:, :3], ref[1:, :3]),
    ]
    results = [policy_loss(p, cfg, TOTALS) for p in parts]
    total = sum(loss for loss, _ in results)
    total.backward()
    assert total.item() == approx(full.item())
    assert split.logprobs.grad.flatten().tolist() == approx(full_grad.flatten().tolist())
    _, full_metrics = policy_loss(batch(), cfg, TOTALS)
    for key, value in full_metrics.items():
        assert sum(m[key] for _, m in results) == approx(value)


def with_masked(rows, value):
    return [rows[0], rows[1][:3] + [value]]


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_masked_tokens_do_not_affect_loss_gradient_or_metrics(cfg):
    clean = loss_and_grad(batch(), cfg)
    # Large but finite garbage at the masked position: r = e^70 ~ 2.5e30, ref/pi = e^-90.
    garbage = loss_and_grad(
        batch(lp=with_masked(LP, 30.0), beh=with_masked(BEH, -40.0), ref=with_masked(REF, -60.0)), cfg
    )
    assert garbage[0] == approx(clean[0])
    assert garbage[1][0] == approx(clean[1][0]) and garbage[1][1] == approx(clean[1][1])
    assert garbage[2] == approx(clean[2])


def test_masked_tokens_whose_ratio_overflows_do_not_poison_the_loss():
    inp = batch(lp=with_masked(LP, 800.0))  # e^(800 + 0.8) = inf in float64; A = -2 gives per-token +inf
    loss, grad, _ = loss_and_grad(inp, LossConfig())
    assert math.isfinite(loss) and all(math.isfinite(g) for row in grad for g in row)


def test_gspo_clips_one_ratio_per_sequence_and_each_token_carries_it():
    # s_i = exp(mean of the sequence's counted log-ratios): seq 0 e^0.155, seq 1 e^-0.05, both inside [0.8, 1.2]
    s0, s1 = e((0.4 - 0.1 + 0.22 + 0.1) / 4), e((-0.5 + 0.3 + 0.05) / 3)
    loss, grad, metrics = loss_and_grad(batch(), LossConfig(kind="gspo"))
    assert loss == approx((-s0 * 1 + -(s1 * -2)) / 2)
    # GSPO-token: d/dlogp_t of sg[s_i] * pi_t / sg[pi_t] is s_i on every counted token, / (length * 2)
    assert grad[0] == approx([-s0 / 8] * 4) and grad[1] == approx([2 * s1 / 6] * 3 + [0.0])
    assert metrics["clipped"] == 0.0
    # The paper's clip range (3e-4, 4e-4): both sequences clipped, no gradient anywhere
    loss, grad, metrics = loss_and_grad(batch(), LossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4))
    assert loss == approx((-1.0004 + -(0.9997 * -2)) / 2)
    assert grad == [[0.0] * 4, [0.0] * 4] and metrics["clipped"] == 7.0
    with pytest.raises(ValidationError, match="tis_cap must be unset"):
        LossConfig(kind="gspo", tis_cap=2.0)


def test_sequence_mask_drops_a_sequence_whose_ratio_product_exceeds_the_cap():
    # products: seq 0 e^0.62 = 1.86 > 1.3 (weight 0), seq 1 e^-0.15 = 0.86 (every token weighted so)
    w1 = e(-0.15)
    loss, grad, metrics = loss_and_grad(batch(), LossConfig(tis_cap=1.3, tis_mode="sequence_mask"))
    assert loss == approx((0.0 + 3 * (-w1 * -2) / 3) / 2)
    assert grad[0] == approx([0.0] * 4) and grad[1] == approx([2 * w1 / 6] * 3 + [0.0])
    assert metrics["tis_weight"] == approx(3 * w1)
    loss, *_ = loss_and_grad(batch(), LossConfig(tis_cap=1.3, tis_mode="sequence_truncate"))
    assert loss == approx((4 * -1.3 / 4 + 3 * (-w1 * -2) / 3) / 2)
    loss, *_ = loss_and_grad(batch(), LossConfig(tis_cap=1.3, tis_mode="token_mask"))
    w0, w1s = [0.0, e(-0.1), e(0.22), e(0.1)], [e(-0.5), 0.0, e(0.05)]  # 1.492 and 1.350 dropped
    assert loss == approx((sum(-w for w in w0) / 4 + sum(2 * w for w in w1s) / 3) / 2)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_ratio_multiplies_each_tokens_kl_by_the_policy_ratio(estimator):
    kl = {"k2": lambda x: x * x / 2, "k3": lambda x: e(-x) + x - 1}[estimator]
    r0, r1 = [e(d) for d in (0.4, -0.1, 0.22, 0.1)], [e(d) for d in (-0.5, 0.3, 0.05)]
    k0 = [kl(x) * r for x, r in zip((0.1, -0.2, 0.0, 0.3), r0, strict=True)]
    k1 = [kl(x) * r for x, r in zip((0.5, -0.1, 0.2), r1, strict=True)]
    cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator, kl_ratio=True)
    loss, _, metrics = loss_and_grad(batch(), cfg)
    assert loss == approx(((sum(G0) + 0.1 * sum(k0)) / 4 + (sum(G1) + 0.1 * sum(k1)) / 3) / 2)
    assert metrics["kl"] == approx(sum(k0) + sum(k1))


def test_per_token_advantages_weigh_each_token_and_equal_the_broadcast_sequence_advantage():
    same = batch(adv=[[1.0] * 4, [-2.0] * 4])
    assert loss_and_grad(same, LossConfig())[:2] == loss_and_grad(batch(), LossConfig())[:2]
    # per token, unclipped tokens of seq 0 (r = e^-0.1, e^0.1) with advantages 0.5 and -3:
    # -min(r*A, clip(r)*A): A=-3 at r=e^0.1 (inside the clip range) gives 3 e^0.1
    per_token = batch(adv=[[0.0, 0.5, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    loss, grad, _ = loss_and_grad(per_token, LossConfig())
    assert loss == approx((-0.5 * e(-0.1) + 3 * e(0.1)) / 4 / 2)
    assert grad[0] == approx([0.0, -0.5 * e(-0.1) / 8, 0.0, 3 * e(0.1) / 8])


# -- the k3 KL's bound (the reward's, verl's) ------------------------------------------------------


def _k3_grad(gap: float, dtype=torch.float64) -> tuple[float, float]:
    """k3's value and d/dlogp for one token ``gap`` nats from the reference (log pi - log ref)."""
    lp = torch.tensor([[-1.0 + gap]], dtype=dtype, requires_grad=True)
    k = kl_estimate(lp, torch.tensor([[-1.0]], dtype=dtype), "k3")
    k.sum().backward()
    return k.item(), lp.grad.item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_k3_in_the_loss_is_bounded_far_below_the_reference(dtype):
    # Unclamped, 30 nats below the reference k3's gradient is 1 - e^30 = -1.1e13 (inf in bf16).
    value, grad = _k3_grad(-30.0, dtype)
    assert value == K3_BOUND and math.isfinite(grad) and abs(grad) <= e(3.0)
    # And through the whole loss: kl_coef x a bounded gradient, no NaN from e^huge.
    inp = batch(
        lp=[[-31.0, -1.0], [-1.0, -1.0]], beh=[[-31.0, -1.0]] * 2, ref=[[-1.0] * 2] * 2, mask=[[1, 1]] * 2
    )
    loss, g, metrics = loss_and_grad(inp, LossConfig(kl_coef=0.5), Totals(tokens=4, sequences=2))
    assert math.isfinite(loss) and all(abs(x) <= 0.5 * e(3.0) for row in g for x in row)
    assert metrics["kl"] == approx(K3_BOUND)


def test_k3_is_unchanged_inside_the_bound_and_equals_the_rewards():
    for gap in (-2.5, -1.0, -0.1, 0.0, 0.3, 2.0, 9.0):
        value, grad = _k3_grad(gap)
        assert value == approx(e(-gap) + gap - 1.0) and grad == approx(1.0 - e(-gap))
    gaps = np.array([-40.0, -30.0, -2.5, -0.2, 0.0, 0.7, 12.0, 40.0])
    learner = kl_estimate(t64(gaps - 1.0), t64(np.full(8, -1.0)), "k3").numpy()
    assert learner == pytest.approx(kl_penalty(gaps - 1.0, np.full(8, -1.0), "k3"), rel=1e-12)


# -- the critic's value loss ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_clip_fraction_counts_only_tokens_the_clip_moved(dtype):
    # |v - old| = 0.3 < 0.5: the clip does not act. Yet old + (v - old) is v off by one ulp, and
    # its squared error is the larger: a round trip would count this token as clipped.
    v, old, ret = (torch.tensor([[x]], dtype=dtype) for x in (0.2, -0.1, 0.0))
    assert (old + (v - old).clamp(-0.5, 0.5) - ret) ** 2 > (v - ret) ** 2  # the trap is there
    loss, m = value_loss(v, old, ret, torch.ones(1, 1), 0.5, "token", Totals(tokens=1, sequences=1))
    assert m["vf_clipped"] == 0.0
    # A token the clip moved and whose clipped error wins is still counted.
    far = torch.tensor([[0.9]], dtype=dtype)
    _, m = value_loss(
        far, old, torch.tensor([[2.0]], dtype=dtype), torch.ones(1, 1), 0.5, "token", Totals(1, 1)
    )
    assert m["vf_clipped"] == 1.0


def multi_turn_episodes() -> tuple[LossInputs, float, float, float, float]:
    """Two rows of width 24 whose learner-generator gaps d = logp - behavior are set token by token;
    returns the inputs and the expected sums (|d| all, |d| after env, its weight) and tokens.

    row 0, a 3-turn episode:  0-4 turn 1 (d = +0.1)      5-7 env (mask 0, behavior 0.0, logp -5)
                              8-15 turn 2 (d = -0.2)     16-17 turn 2 (d = +0.05): past the window
                              18-19 env                  20-21 turn 3 (d = 0.3, masks 0.5 and 1)
                              22-23 padding (mask 0, garbage logp)
    row 1, single turn:       0-19 (d = 0.01)            20-23 padding
    """
    lp = torch.full((2, 24), -1.0, dtype=torch.float64)
    beh = lp.clone()
    mask = torch.ones(2, 24, dtype=torch.float64)
    beh[0, 0:5] -= 0.1
    beh[0, 8:16] += 0.2
    beh[0, 16:18] -= 0.05
    beh[0, 20:22] -= 0.3
    beh[1, 0:20] -= 0.01
    for lo, hi in ((5, 8), (18, 20), (22, 24)):
        mask[0, lo:hi], beh[0, lo:hi], lp[0, lo:hi] = 0.0, 0.0, -5.0
    mask[0, 20] = 0.5
    mask[1, 20:], lp[1, 20:] = 0.0, -7.0
    gap = 0.5 + 1.6 + 0.1 + 0.3 * 0.5 + 0.3 + 0.2
    after, weight = 1.6 + 0.3 * 0.5 + 0.3, 8 + 1.5
    tokens = 5 + 10 + 1.5 + 20
    inp = LossInputs(lp.clone().requires_grad_(), beh, torch.ones(2), mask, lp - 0.1)
    return inp, gap, after, weight, tokens


def test_after_masked_span_marks_the_first_window_tokens_after_each_env_span():
    inp, *_ = multi_turn_episodes()
    want = torch.zeros(2, 24, dtype=torch.bool)
    want[0, 8:16] = want[0, 20:22] = True  # not 16-17 (past 8), not the padding, not row 1
    assert torch.equal(after_masked_span(inp.mask), want)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_logprob_gap_counts_trained_tokens_only_and_the_window_after_env(cfg):
    inp, gap, after, weight, tokens = multi_turn_episodes()
    _, m = policy_loss(inp, cfg, Totals(tokens=int(tokens), sequences=2, max_tokens=24))
    # An env token counted would add 5 per token; a window of 7 or 9 tokens would move by 0.2
    # or 0.05; padding counted would add 7.
    assert m["logprob_abs_diff"] == approx(gap)
    assert m["after_env_abs_diff"] == approx(after) and m["after_env_weight"] == approx(weight)
    means = token_means({n: m[n] for n in policy_sums(cfg)}, tokens)
    assert means["logprob_abs_diff"] == approx(gap / tokens)
    assert means["logprob_abs_diff_after_env"] == approx(after / weight)
    assert "after_env_weight" not in means
    # Summed over micro-batches (one row each) the sums are the whole batch's.
    fields = (inp.logprobs, inp.behavior_logprobs, inp.advantages, inp.mask, inp.ref_logprobs)
    halves = [policy_loss(LossInputs(*(x[i : i + 1] for x in fields)), cfg, TOTALS)[1] for i in (0, 1)]
    for n in ("logprob_abs_diff", "after_env_abs_diff", "after_env_weight"):
        assert halves[0][n] + halves[1][n] == approx(m[n])


def test_logprob_gap_leaves_the_loss_and_its_gradient_alone():
    """The gap comes from the loss's own log-probs (no second forward) and adds nothing to it."""
    cfg = LossConfig()
    inp, *_ = multi_turn_episodes()
    loss, _ = policy_loss(inp, cfg, TOTALS)
    (grad,) = torch.autograd.grad(loss, inp.logprobs)
    moved, *_ = multi_turn_episodes()
    moved.behavior_logprobs[0, 5:8] = -30.0  # env tokens: no effect on anything
    loss2, m2 = policy_loss(moved, cfg, TOTALS)
    assert loss2.item() == approx(loss.item())
    assert torch.equal(torch.autograd.grad(loss2, moved.logprobs)[0], grad)
    assert m2["logprob_abs_diff"] == approx(multi_turn_episodes()[1])


@pytest.mark.parametrize("cfg", [*CONFIGS.values(), LossConfig(kind="sft")], ids=[*CONFIGS, "sft"])
def test_policy_sums_name_exactly_the_sums_the_loss_returns(cfg):
    _, m = policy_loss(batch(), cfg, TOTALS)
    assert tuple(m) == policy_sums(cfg)
    assert ("logprob_abs_diff" in m) == (cfg.kind != "sft")  # SFT has no generator log-probs


def test_a_step_without_env_spans_reports_no_after_env_mean():
    _, m = policy_loss(batch(), LossConfig(), TOTALS)
    means = token_means({n: m[n] for n in policy_sums(LossConfig())}, 7.0)
    assert means["logprob_abs_diff"] == approx(1.67 / 7)
    assert "logprob_abs_diff_after_env" not in means  # absent, not 0
