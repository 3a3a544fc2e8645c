"""The SLO planner: the replica counts for what comes next, from a deployment's recent samples.

`Planner.decide(history, current)` is a pure function of its arguments, the config, the
profile and the mode misses: state such as "when did this pool last change" is read from
the samples' replica counts, so a recorded series replays to the same decisions.
`Planner.learned(history, current)` is the planner after that interval: its profile
refined by what the workers measured, and a mode's miss with all its workers remembered.

1. Samples: `history` (oldest first) then `current`; only those of the last
   max(cooldown_s, window_s) are read, plus the one before (it tells whether the window is covered).
2. Load: the predictor's load at current + the profile's start-up time (predictor.py), so
   that a worker started now is ready for the load it is started for.
3. Per pool, the model's need at that load (sizing.py), then:
   - up at once when the need (clamped to the pool's bounds) is above the current count;
   - one more when the observed p90 (TTFT for prefill, ITL for decode, either for
     aggregated) missed its target although the model said the count was enough, and
     the pool last changed at least start-up + one interval ago ("observed slo");
   - down only when the pool last changed at least `cooldown_s` ago ("cooldown"), the
     observed p90s of the cool-down window stayed within (1 - dead_band) of their
     targets, and the lower count is enough for every sample of the window at
     g = (1 + dead_band) / (1 - dead_band) times that sample's own load ("hold" otherwise).
   Noise of +-dead_band around a steady load therefore cannot move a count down and then
   up again (nor up, then down): the down rule needs a load g times above anything the
   up rule saw from the same band, and the predictor's trend ignores such noise.
4. Mode (AUTO): the running mode is kept unless the other one, after the cool-down,
   meets the SLO where this one cannot, or saves `mode_switch_saving` replicas at the
   predicted load and at g times every window sample's load. When this mode needs more than
   max_workers and the other fewer, only the cool-down after a mode switch holds the switch.
   What the modes served outranks the model (mode_misses.py): when the running mode has
   missed the SLO with all the workers it may run (max_workers, or each pool at its
   max_replicas) and, by the model, none to spare, for MISS_INTERVALS intervals after its last change
   was ready ("observed miss"), and the model does not rate the other mode worse, the
   deployment switches; a mode that missed at this load (within g of the predicted load or of
   one window sample's) in the last `mode_memory_s` is never switched to. A switch sizes the new
   pools at the larger of the two. With nothing running, the cheaper mode at the
   predicted load (a tie goes to disaggregated).
5. Bounds: each pool within its PoolBounds; while the total is above max_workers, one
   worker is cut ("bound: max_workers"): from a pool's growth or from a pool whose last
   change is a cool-down old (never from one changed more recently, unless nothing else
   can give), the pool best covered after losing it first (chosen - 1 over needed; ties:
   the larger). Two pools that both want more cannot swap a worker every interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from splitserve.services.planner.config import PlannerConfig, PlannerMode
from splitserve.services.planner.decision import Binding, Decision, PoolDecision
from splitserve.services.planner.mode_misses import MISS_INTERVALS, ModeMiss, ModeMisses
from splitserve.services.planner.predictor import LoadPredictor, PredictedLoad
from splitserve.services.planner.profile import CapacityProfile, observations_from_sample
from splitserve.services.planner.samples import MetricsSample, ReplicaCounts
from splitserve.services.planner.sizing import PoolNeed, SizingModel

DISAGGREGATED_POOLS = ("prefill", "decode")
AGGREGATED_POOLS = ("aggregated",)


@dataclass(frozen=True, slots=True)
class Planner:
    config: PlannerConfig
    profile: CapacityProfile
    misses: ModeMisses = ModeMisses()

    @property
    def predictor(self) -> LoadPredictor:
        return LoadPredictor(self.config.window_s, self.config.ewma_alpha, self.config.dead_band)

    def with_profile(self, profile: CapacityProfile) -> Planner:
        return replace(self, profile=profile)

    def learned(self, history: Sequence[MetricsSample], current: MetricsSample) -> Planner:
        """This planner after the interval of `current` (`history` as for `decide`): its profile
        refined by what the workers measured, and the running mode's observed miss remembered."""
        planner = self.with_profile(self.profile.refine(
            observations_from_sample(current, history[-1] if history else None)))
        miss = self.sustained_miss(self._recent([*history, current]))
        if miss is not None and self.config.mode is PlannerMode.AUTO:
            planner = replace(planner, misses=self.misses.with_miss(miss, self.config.mode_memory_s))
        return planner

    def sustained_miss(self, samples: list[MetricsSample]) -> ModeMiss | None:
        """The running deployment's miss (mode_misses.py), if the samples show one: it cannot
        grow (max_workers, or every pool at its max_replicas), the model gives it no worker to
        spare at the load planned for (it needs at least those it runs), and each of the last
        MISS_INTERVALS or more intervals that began after its last change was ready missed the
        TTFT or the ITL target. A miss with a worker to spare is a transient, such as the
        backlog after a shift in the mix, and the pools' observed-SLO rule answers it."""
        current = samples[-1]
        if not self._cannot_grow(current.replicas):
            return None
        ready_at = _last_change(samples, None) + self.profile.startup_s
        missed: list[tuple[MetricsSample, str]] = []       # the trailing run of settled intervals that missed
        for s in reversed(samples):
            worst = self._worst_miss(s) if s.timestamp - s.interval_s >= ready_at else None
            if worst is None:
                break
            missed.append((s, worst))
        if len(missed) < MISS_INTERVALS:
            return None
        load = self.predictor.predict(samples, self.profile.startup_s)
        model = SizingModel.of(self.profile, self.config)
        if self._mode_cost(model, load, current.replicas.disaggregated)[1] < current.replicas.total:
            return None
        first = missed[-1][0]
        return ModeMiss(current.timestamp, current.replicas, load,
                        current.timestamp - first.timestamp + first.interval_s, missed[0][1])

    def _cannot_grow(self, replicas: ReplicaCounts) -> bool:
        """max_workers reached, or every pool of the mode at its max_replicas."""
        pools = DISAGGREGATED_POOLS if replicas.disaggregated else AGGREGATED_POOLS
        return replicas.total >= self.config.max_workers or \
            all(replicas.count(p) >= self.config.bounds(p).max_replicas for p in pools)

    def _worst_miss(self, sample: MetricsSample) -> str | None:
        """The target this sample's p90 missed by the most ("itl p90 0.79 s > 0.4 s"); None: met both."""
        slo = self.config.slo
        ratios = [(seen / target, f"{name} p90 {seen:.3g} s > {target:.3g} s")
                  for name, seen, target in (("ttft", sample.ttft_p90_s, slo.ttft_p90_s),
                                             ("itl", sample.itl_p90_s, slo.itl_p90_s))
                  if seen is not None and seen > target]
        return max(ratios)[1] if ratios else None

    def decide(self, history: Sequence[MetricsSample], current: MetricsSample) -> Decision:
        samples = self._recent([*history, current])
        model = SizingModel.of(self.profile, self.config)
        load = self.predictor.predict(samples, self.profile.startup_s)
        window = [s for s in samples if s.timestamp >= current.timestamp - self.config.cooldown_s]
        sustained = [self.predictor.observed(s).scaled(self.config.noise_ratio) for s in window]
        disaggregated, mode_reason = self._choose_mode(model, load, sustained, samples)
        names = DISAGGREGATED_POOLS if disaggregated else AGGREGATED_POOLS
        if disaggregated == current.replicas.disaggregated:
            pools = [self._pool(name, model, load, sustained, samples, window) for name in names]
        else:
            pools = [self._fresh_pool(name, model, load, sustained) for name in names]
        pools = self._fit_max_workers(pools, samples)
        counts = {p.pool: p.chosen for p in pools}
        replicas = (ReplicaCounts.of_pools(counts["prefill"], counts["decode"]) if disaggregated
                    else ReplicaCounts.of_aggregated(counts["aggregated"]))
        return Decision(current.timestamp, current.replicas, replicas, tuple(pools), load, current,
                        mode_reason, len(samples))

    # -- phases ------------------------------------------------------------------------------
    def _recent(self, samples: list[MetricsSample]) -> list[MetricsSample]:
        stamps = [s.timestamp for s in samples]
        if any(b <= a for a, b in zip(stamps, stamps[1:])):
            raise ValueError("samples must be in strictly increasing timestamp order, current last")
        cutoff = stamps[-1] - max(self.config.cooldown_s, self.config.window_s)
        start = max((i for i, t in enumerate(stamps) if t <= cutoff), default=0)
        return samples[start:]

    def _need(self, model: SizingModel, pool: str, load: PredictedLoad) -> PoolNeed:
        if pool == "prefill":
            return model.prefill(load)
        if pool == "decode":
            return model.decode(load)
        return model.aggregated(load, self.config.aggregated.max_replicas)

    def _pool(self, name: str, model: SizingModel, load: PredictedLoad, sustained: list[PredictedLoad],
              samples: list[MetricsSample], window: list[MetricsSample]) -> PoolDecision:
        bounds, current = self.config.bounds(name), samples[-1]
        count = current.replicas.count(name)
        need = self._need(model, name, load)
        since_change = current.timestamp - _last_change(samples, name)
        wanted, binding = need.count, need.binding
        if wanted <= count and need.reachable and self._missed_slo(name, current, 1.0) \
                and since_change >= self.profile.startup_s + current.interval_s:
            wanted, binding = count + 1, Binding.OBSERVED_SLO
        target = bounds.clamp(wanted)
        if target != wanted:
            binding = Binding.MIN if target > wanted else Binding.MAX
        if count > bounds.max_replicas:
            target, binding = bounds.max_replicas, Binding.MAX
        elif target < count:
            target, binding = self._scale_down(name, model, count, sustained, window, since_change)
        return PoolDecision(name, count, need.count, target, binding, need.reachable, need.detail)

    def _scale_down(self, name: str, model: SizingModel, count: int, sustained: list[PredictedLoad],
                    window: list[MetricsSample], since_change: float) -> tuple[int, Binding]:
        """(count, binding) when the predicted load wants fewer than `count` workers."""
        if since_change < self.config.cooldown_s:
            return count, Binding.COOLDOWN
        if any(self._missed_slo(name, s, 1.0 - self.config.dead_band) for s in window):
            return count, Binding.HOLD
        held = max((self._need(model, name, x) for x in sustained), key=lambda n: n.count)
        floor = self.config.bounds(name).clamp(held.count)
        if floor >= count:
            return count, Binding.HOLD
        return floor, held.binding if floor == held.count else Binding.MIN

    def _fresh_pool(self, name: str, model: SizingModel, load: PredictedLoad,
                    sustained: list[PredictedLoad]) -> PoolDecision:
        """A pool of a mode switched to: sized for the predicted and the window's sustained load."""
        need = self._need(model, name, load)
        held = max((self._need(model, name, x) for x in sustained), key=lambda n: n.count, default=need)
        bigger = need if need.count >= held.count else held
        target = self.config.bounds(name).clamp(bigger.count)
        binding = bigger.binding if target == bigger.count else (Binding.MIN if target > bigger.count
                                                                 else Binding.MAX)
        return PoolDecision(name, 0, need.count, target, binding, need.reachable, need.detail)

    def _missed_slo(self, pool: str, sample: MetricsSample, fraction: float) -> bool:
        """Whether the pool's observed p90 exceeded `fraction` of its target in this sample."""
        slo = self.config.slo
        ttft = sample.ttft_p90_s is not None and sample.ttft_p90_s > fraction * slo.ttft_p90_s
        itl = sample.itl_p90_s is not None and sample.itl_p90_s > fraction * slo.itl_p90_s
        return {"prefill": ttft, "decode": itl}.get(pool, ttft or itl)

    def _choose_mode(self, model: SizingModel, load: PredictedLoad, sustained: list[PredictedLoad],
                     samples: list[MetricsSample]) -> tuple[bool, str]:
        mode, current = self.config.mode, samples[-1]
        if mode is not PlannerMode.AUTO:
            return mode is PlannerMode.DISAGGREGATED, f"mode {mode.value} (configured)"
        split, joined = self._mode_cost(model, load, True), self._mode_cost(model, load, False)
        costs = f"disaggregated needs {split[1]}, aggregated {joined[1]}"
        if current.replicas.total == 0:
            disaggregated = split <= joined
            return disaggregated, f"start {'disaggregated' if disaggregated else 'aggregated'}: {costs}"
        running = current.replicas.disaggregated
        name = "disaggregated" if running else "aggregated"
        other_missed = self.misses.known(not running, [load.scaled(self.config.noise_ratio), *sustained],
                                         current.timestamp, self.config.mode_memory_s)
        if other_missed is not None:
            return running, f"keep {name}: {other_missed.describe()}; {costs}"
        missing = self.sustained_miss(samples)
        if missing is not None and self._mode_cost(model, load, not running) <= self._mode_cost(model, load, running):
            return not running, f"switch from {name}: observed miss, {missing.describe()}; {costs}"
        if current.timestamp - _last_change(samples, None) < self.config.cooldown_s \
                and not self._pressed(model, load, running, samples):
            return running, f"keep {name} (cool-down): {costs}"
        if all(self._other_mode_better(model, x, running) for x in [load, *sustained]):
            return not running, f"switch from {name}: {costs}, over the whole cool-down window"
        return running, f"keep {name}: {costs}"

    def _pressed(self, model: SizingModel, load: PredictedLoad, running: bool,
                 samples: list[MetricsSample]) -> bool:
        """The running mode needs more than max_workers and the other fewer, and no mode switch
        is in the samples: the cool-down after a count change (or the start) does not hold a
        switch then, since every interval in this mode misses the SLO. The cool-down after a
        switch still holds, so the modes cannot flap."""
        if any(a.replicas.disaggregated != b.replicas.disaggregated for a, b in zip(samples, samples[1:])):
            return False
        this_total = self._mode_cost(model, load, running)[1]
        return this_total > self.config.max_workers and self._other_mode_better(model, load, running)

    def _mode_cost(self, model: SizingModel, load: PredictedLoad, disaggregated: bool) -> tuple[bool, int]:
        """(unreachable, replicas) of one mode at this load; smaller is better."""
        needs = [(self._need(model, p, load), self.config.bounds(p))
                 for p in (DISAGGREGATED_POOLS if disaggregated else AGGREGATED_POOLS)]
        return (not all(n.reachable for n, _ in needs),
                sum(max(n.count, b.min_replicas) for n, b in needs))

    def _other_mode_better(self, model: SizingModel, load: PredictedLoad, running: bool) -> bool:
        (this_unreachable, this_total) = self._mode_cost(model, load, running)
        (other_unreachable, other_total) = self._mode_cost(model, load, not running)
        if this_unreachable != other_unreachable:
            return this_unreachable
        return other_total + self.config.mode_switch_saving <= this_total

    def _fit_max_workers(self, pools: list[PoolDecision], samples: list[MetricsSample]) -> list[PoolDecision]:
        """Cut one worker at a time while the total is above max_workers, from a pool's growth or
        from a pool out of its cool-down, the pool best covered after the cut first. A pool
        that changed within the cool-down keeps its count, so the cap cannot trade a worker
        back and forth between two pools that both want more."""
        now = samples[-1].timestamp

        def settled(p: PoolDecision) -> bool:
            return p.current == 0 or now - _last_change(samples, p.pool) >= self.config.cooldown_s

        excess = sum(p.chosen for p in pools) - self.config.max_workers
        while excess > 0:
            cuttable = [p for p in pools if p.chosen > self.config.bounds(p.pool).min_replicas]
            cuttable = [p for p in cuttable if p.chosen > p.current or settled(p)] or cuttable
            victim = max(cuttable, key=lambda p: ((p.chosen - 1) / max(p.needed, 1), p.chosen))
            pools = [replace(p, chosen=p.chosen - 1, binding=Binding.MAX_WORKERS) if p is victim else p
                     for p in pools]
            excess -= 1
        return pools


def _last_change(samples: list[MetricsSample], pool: str | None) -> float:
    """When the pool's count (None: any count) or the mode last changed; the oldest sample's
    timestamp when the samples show no change (the change was at least that long ago)."""
    def key(s: MetricsSample) -> tuple:
        return (s.replicas.disaggregated, s.replicas if pool is None else s.replicas.count(pool))

    last = key(samples[-1])
    for i in range(len(samples) - 1, 0, -1):
        if key(samples[i - 1]) != last:
            return samples[i].timestamp
    return samples[0].timestamp
