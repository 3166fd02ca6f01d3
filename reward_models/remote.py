"""Reward models behind servers: a PRM served by ``python -m reward_models.serve``.

``RemotePRM`` is a ``RewardModel`` like ``ProcessRewardModel`` and pays the same rewards (the same
``step_rewards``), but the model runs in the server, which batches the requests of every trainer
that calls it. A batch is split into requests of ``request_size`` solutions sent concurrently, so
several server replicas (comma-separated URLs) share it. When the server cannot answer after the
client's retries, ``score`` raises ``ServiceError`` naming the URL (the env adds the batch's problems);
nothing of a half-scored batch is returned.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from envs.modes import PrmAggregation, member_of
from envs.rewards import RewardOutput, StepContext
from reward_models.prm import step_rewards
from models.remote import ClientSettings, ServiceClient, ServiceError


class RemotePRM:
    """A PRM on a ``reward_models.serve`` server, behind the ``RewardModel`` protocol.

    Args:
        urls: base URL(s) of the server(s), e.g. ``http://127.0.0.1:8001``.
        model: the served name to use (default: the one the servers serve).
        aggregation: how step scores become rewards (as ``ProcessRewardModel``).
        request_size: solutions per request.
        settings: the client's timeouts, retries and concurrency.
    """

    def __init__(self, urls: str | Sequence[str], model: str | None = None,
                 aggregation: PrmAggregation = PrmAggregation.STEP, request_size: int = 16,
                 settings: ClientSettings = ClientSettings(), name: str = "prm"):
        aggregation = member_of(tuple(PrmAggregation), aggregation, "aggregation")
        if request_size < 1:
            raise ValueError(f"request_size={request_size} must be >= 1")
        self.client = ServiceClient(urls, settings)
        self.model = self.client.served_model(model, "--prm_model_name")
        self.aggregation, self.request_size, self.name = aggregation, request_size, name

    def step_scores(self, problems: Sequence[str], steps: Sequence[Sequence[str]],
                    finished: Sequence[bool] | None = None) -> list[np.ndarray]:
        """Scores [S_b] of every step of each of B solutions, as ``ProcessRewardModel.step_scores``."""
        finished = [False] * len(problems) if finished is None else list(finished)
        starts = range(0, len(problems), self.request_size)
        payloads = [{"model": self.model, "problems": list(problems[s:s + self.request_size]),
                     "steps": [list(x) for x in steps[s:s + self.request_size]],
                     "finished": finished[s:s + self.request_size]} for s in starts]
        answers = self.client.post_many("/v1/score", payloads)
        try:
            scores = [np.asarray(row, dtype=np.float64) for answer in answers for row in answer["step_scores"]]
        except (KeyError, TypeError, ValueError) as error:
            raise ServiceError(f"{', '.join(self.client.urls)} answered without lists of step scores: "
                               f"{type(error).__name__}: {error}") from error
        if len(scores) != len(problems) or any(row.ndim != 1 for row in scores):
            raise ServiceError(f"{', '.join(self.client.urls)} returned {len(scores)} score lists for "
                               f"{len(problems)} solutions")
        return scores

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Per-step reward [B], as ``ProcessRewardModel.score``."""
        scores = self.step_scores([c.problem.problem for c in contexts], [c.steps for c in contexts],
                                  finished=[c.done for c in contexts])
        return step_rewards(scores, contexts, self.aggregation, self.name)
