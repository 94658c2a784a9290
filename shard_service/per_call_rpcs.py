"""The per-call RPCs (Forward, Backward, Step, GradientNorm) for clients without Links: adapters onto the loop's own
work, never a second implementation. What the loop would send the SDK for their steps waits in the call outbox
(call_outbox.py) for FetchTensor."""

from __future__ import annotations

import torch

from shard_service.executor import StageExecutor
from shard_service.optimizer_steps import OptimizerSteps
from shard_service.tied import TiedGradients
from shard_service.verdicts import Verdicts
from shardtrain import errors
from shardtrain.residuals import CLIENT
from shardtrain.v1 import shard_pb2


class PerCallRPCs:
    """The per-call RPCs of one stage for one deployment."""

    def __init__(self, executor: StageExecutor, steps: OptimizerSteps, tied: TiedGradients, verdicts: Verdicts):
        self._executor, self._shard = executor, executor.shard
        self._steps, self._tied, self._verdicts = steps, tied, verdicts

    async def forward_call(self, header: shard_pb2.ForwardHeader, x: torch.Tensor | None) -> None:
        """A Forward call to the first stage: runs as the SDK's forward item would; the last stage keeps the output
        for FetchTensor. Raises this stage's failure; a later stage's is kept in the output's place."""
        self._check_end("Forward", first=True)
        header.keep_output = True
        error = await self._executor.loop_forward(header, x, self._verdicts.last)
        if error is not None:
            raise error

    async def backward_call(self, header: shard_pb2.BackwardHeader, grad: torch.Tensor | None) -> None:
        """A Backward call to the last stage: runs as the SDK's backward item would; the first stage keeps the
        input's gradient (or an earlier stage's failure) for FetchTensor. Raises this stage's failure."""
        self._check_end("Backward", first=False)
        error = await self._executor.loop_backward(header, grad)
        if error is not None:
            raise error

    async def step_call(self, request: shard_pb2.StepRequest) -> None:
        """A Step call to the first stage: the optimizer step goes down the stages as the SDK's step item does.
        FailedPrecondition if it was refused (a listed backward failed here or on a later stage)."""
        self._check_end("Step", first=True)
        if not self._verdicts.take(request.optimizer_step):
            raise errors.FailedPrecondition(f"optimizer step {request.optimizer_step} was settled already")
        failure = await self._steps.step(shard_pb2.LinkStep(request=request))
        if failure:
            raise errors.FailedPrecondition(f"optimizer step {request.optimizer_step} not applied: {failure}")

    async def gradient_norm_call(self, request: shard_pb2.GradientNormRequest) -> tuple[float, list[float]]:
        """A GradientNorm call: the norm of this stage's gradients once the listed backwards are over here, after
        tied weights' gradients were summed for the optimizer step named (each then counted on its first stage)
        and the request's edits applied; and the norms of the parameters it names."""
        shard = self._shard
        stage = shard.stage_for(request.deployment_id)
        await shard.backwards_over(request.backward_steps, "no gradient norm")
        if request.optimizer_step:
            await self._tied.sum(stage, request.optimizer_step)
        counted_elsewhere = [tie.key for tie in shard.plan.tied if tie.stages[0] != shard.plan.stage]
        norm_type = request.norm_type or 2.0

        def norms() -> tuple[float, list[float]]:
            weights = stage.weights
            weights.edit_gradients(request.edits)
            return weights.gradient_norm(norm_type, counted_elsewhere), weights.parameter_norms(norm_type,
                                                                                               request.parameters)
        return await shard.run(norms)

    def _check_end(self, call: str, first: bool) -> None:
        plan = self._shard.plan
        wanted = 0 if first else plan.num_stages - 1
        if plan.stage != wanted:
            raise errors.FailedPrecondition(
                f"{call} goes to the {'first' if first else 'last'} stage (stage {wanted}); this shard holds stage "
                f"{plan.stage}, and the stages pass the work on themselves")
        if first and any(r.producer_stage == CLIENT for r in plan.incoming_residuals) or not first and any(
                CLIENT in r.consumer_stages for r in plan.outgoing_residuals):
            raise errors.FailedPrecondition(f"{call}: this deployment's model takes or returns several tensors; the "
                                            "per-call RPCs carry one each way: drive it over Links (the Python SDK)")
