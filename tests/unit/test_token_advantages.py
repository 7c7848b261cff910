"""PPO-family token advantages against examples computed by hand and against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
from relayrl.coordinator.algorithms.token_advantages import (
    adaptive_kl_coef,
    discounted_returns,
    gae,
    kl_penalty,
    shaped_rewards,
    whiten,
)


def test_gae_by_hand_three_tokens():
    # r = [0, 0, 1] (score on the last token), V = [0.2, 0.4, 0.6], gamma 0.5, lam 0.5 (gamma*lam 0.25):
    # delta_2 = 1 - 0.6 = 0.4;  delta_1 = 0 + 0.5*0.6 - 0.4 = -0.1;  delta_0 = 0 + 0.5*0.4 - 0.2 = 0
    # A_2 = 0.4;  A_1 = -0.1 + 0.25*0.4 = 0;  A_0 = 0 + 0.25*0 = 0
    adv, ret = gae(np.array([0.0, 0.0, 1.0]), np.array([0.2, 0.4, 0.6]), gamma=0.5, lam=0.5)
    assert adv == pytest.approx([0.0, 0.0, 0.4])
    assert ret == pytest.approx([0.2, 0.4, 1.0])


def test_gae_limits_lam_one_is_monte_carlo_lam_zero_is_td():
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=7), rng.normal(size=7)
    gamma = 0.9
    adv, ret = gae(r, v, gamma=gamma, lam=1.0)
    mc = [sum(gamma**k * r[t + k] for k in range(7 - t)) for t in range(7)]
    assert ret == pytest.approx(mc) and adv == pytest.approx(np.array(mc) - v)
    adv0, _ = gae(r, v, gamma=gamma, lam=0.0)
    td = [r[t] + gamma * (v[t + 1] if t < 6 else 0.0) - v[t] for t in range(7)]
    assert adv0 == pytest.approx(td)


def test_gae_equals_its_closed_form_sum_of_discounted_residuals():
    rng = np.random.default_rng(1)
    r, v, gamma, lam = rng.normal(size=9), rng.normal(size=9), 0.95, 0.8
    delta = [r[t] + gamma * (v[t + 1] if t < 8 else 0.0) - v[t] for t in range(9)]
    closed = [sum((gamma * lam) ** k * delta[t + k] for k in range(9 - t)) for t in range(9)]
    assert gae(r, v, gamma, lam)[0] == pytest.approx(closed)


def test_masked_tokens_are_absent_whatever_they_hold():
    rng = np.random.default_rng(2)
    r, v = rng.normal(size=4), rng.normal(size=4)
    # the same four counted tokens with two masked ones (arbitrary contents) between them
    r6, v6 = np.insert(r, [1, 3], [50.0, -7.0]), np.insert(v, [1, 3], [9.0, 3.0])
    mask = [1, 0, 1, 1, 0, 1]
    a4, ret4 = gae(r, v, 0.9, 0.7)
    a6, ret6 = gae(r6, v6, 0.9, 0.7, mask=mask)
    counted = np.flatnonzero(mask)
    assert a6[counted] == pytest.approx(a4) and ret6[counted] == pytest.approx(ret4)
    assert a6[[1, 4]].tolist() == [0.0, 0.0] and ret6[[1, 4]].tolist() == [0.0, 0.0]
    g4, g6 = discounted_returns(r, 0.9), discounted_returns(r6, 0.9, mask=mask)
    assert g6[counted] == pytest.approx(g4) and g6[[1, 4]].tolist() == [0.0, 0.0]


def test_reinforce_pp_by_hand_with_a_kl_penalty():
    # score 1 on the last of 3 tokens, k1 KL [0.2, -0.1, 0.4], beta 0.5 -> r = [-0.1, 0.05, 0.8]
    kl = kl_penalty([-1.0, -2.0, -0.5], [-1.2, -1.9, -0.9], "k1")
    assert kl == pytest.approx([0.2, -0.1, 0.4])
    r = shaped_rewards(1.0, 3, kl=kl, beta=0.5)
    assert r == pytest.approx([-0.1, 0.05, 0.8])
    # gamma 1: returns-to-go [0.75, 0.85, 0.8]
    g = discounted_returns(r, gamma=1.0)
    assert g == pytest.approx([0.75, 0.85, 0.8])
    # batch whitening with a second sample of returns [0.0, 0.2]: five values, mean 0.52,
    # unbiased variance (0.23^2 + 0.33^2 + 0.28^2 + 0.52^2 + 0.32^2) / 4 = 0.613 / 4 = 0.15325
    a, b = whiten([g, np.array([0.0, 0.2])])
    std = np.sqrt(0.15325)
    assert a == pytest.approx((g - 0.52) / std, rel=1e-6) and b == pytest.approx(
        (np.array([0, 0.2]) - 0.52) / std
    )


def test_whiten_gives_zero_mean_unit_unbiased_std_over_counted_tokens_only():
    rng = np.random.default_rng(3)
    xs = [rng.normal(3, 5, size=n) for n in (4, 7, 1)]
    masks = [[1, 1, 0, 1], [1] * 7, [0]]
    out = whiten(xs, masks)
    counted = np.concatenate([o[np.asarray(m) > 0] for o, m in zip(out, masks, strict=True)])
    assert counted.mean() == pytest.approx(0.0, abs=1e-9) and counted.std(ddof=1) == pytest.approx(
        1.0, rel=1e-6
    )
    assert out[0][2] == 0.0 and out[2].tolist() == [0.0]
    scaled = whiten(xs, masks, shift_mean=False)
    kept = np.concatenate([o[np.asarray(m) > 0] for o, m in zip(scaled, masks, strict=True)])
    source = np.concatenate([x[np.asarray(m) > 0] for x, m in zip(xs, masks, strict=True)])
    assert kept.mean() == pytest.approx(source.mean())


def test_kl_estimators_by_hand():
    lp, ref = [-1.0], [-1.5]  # log(pi/ref) = 0.5
    assert kl_penalty(lp, ref, "k1") == pytest.approx([0.5])
    assert kl_penalty(lp, ref, "k2") == pytest.approx([0.125])
    assert kl_penalty(lp, ref, "k3") == pytest.approx([np.exp(-0.5) + 0.5 - 1.0])
    assert kl_penalty([-1.5], [-1.0], "abs") == pytest.approx([0.5])
    # clamped to [-10, 10] as verl's low_var_kl: log ratio 40 gives 39, -40 gives e^40 - 41
    assert kl_penalty([0.0, -40.0], [-40.0, 0.0], "k3").tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="unknown KL penalty 'k9'"):
        kl_penalty(lp, ref, "k9")


def test_adaptive_kl_coefficient_moves_toward_the_target_and_is_bounded():
    coef = 0.2
    for _ in range(50):  # KL far above target: the coefficient grows, 2% of n/horizon at most per step
        new = adaptive_kl_coef(coef, observed_kl=100.0, target=1.0, horizon=100, n_steps=10)
        assert new == pytest.approx(coef * 1.02)
        coef = new
    assert adaptive_kl_coef(coef, observed_kl=1.0, target=1.0, horizon=100, n_steps=10) == coef
    assert adaptive_kl_coef(0.2, observed_kl=0.0, target=1.0, horizon=100, n_steps=10) == pytest.approx(0.196)
    with pytest.raises(ValueError):
        adaptive_kl_coef(0.2, 1.0, target=0.0, horizon=100, n_steps=1)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="one value per token"):
        gae(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="mask has 2 values for 3 tokens"):
        discounted_returns(np.zeros(3), mask=[1, 1])
