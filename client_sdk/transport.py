"""The SDK's RPCs for one deployment: into the first stage, out of the last, and to every stage at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from client_sdk.batch import MAIN, TARGET, Batch
from client_sdk.sdk_links import SdkLinks
from shardtrain import auth, errors, optim, shm, wire
from shardtrain.errors import InvalidArgument
from shardtrain.rpc import SHARD_SERVICE, Peer
from shardtrain.rpc_streams import RequestReader
from shardtrain.settings import Security, Timeouts, checksums_from_env
from shardtrain.v1 import shard_pb2, tensor_pb2


class StageClients:
    """One Peer per stage of a deployment, created on the IoLoop (grpc.aio channels belong to a loop)."""

    def __init__(self, deployment_id: str, addresses: Sequence[str], security: Security, timeouts: Timeouts,
                 encodings: tensor_pb2.WireEncodings | None = None, secret: str = ""):
        self.deployment_id = deployment_id
        self.secret = secret  # DeployResponse.deployment_secret
        self.stages = [Peer(f"shard at {address} (stage {index})", address, SHARD_SERVICE,
                            security, timeouts.rpc) for index, address in enumerate(addresses)]
        for peer in self.stages:  # every call on the deployment carries its secret
            peer.metadata = auth.with_deployment(peer.metadata, secret)
        self._encodings = encodings or tensor_pb2.WireEncodings()
        self._segments: shm.SegmentPool | None = None
        self._checksums = checksums_from_env()
        self.probe_timeout = timeouts.probe
        self._links = SdkLinks(deployment_id, self.stages[0], self.stages[-1], self._options, timeouts.rpc,
                               diagnose=self.silent_stages)

    async def probe(self) -> None:
        """Finds which stages share this host: tensors to and from them go through shared memory."""
        if not shm.available():
            return
        await asyncio.gather(self.stages[0].probe(), self.stages[-1].probe())
        if self.stages[0].same_host or self.stages[-1].same_host:
            self._segments = shm.SegmentPool()

    def _options(self, stage: Peer, kind: str) -> wire.SendOptions:
        segments = self._segments if stage.same_host else None
        return wire.SendOptions(encoding=getattr(self._encodings, kind), segments=segments, checksum=self._checksums)

    def key(self, step: int, microbatch: int = 0) -> shard_pb2.StepKey:
        """The wire key of a step of this deployment."""
        return shard_pb2.StepKey(deployment_id=self.deployment_id, step=step, microbatch=microbatch)

    async def planned_step(self, step: int, share: Sequence[Batch], batch_rows: int,
                           loss: shard_pb2.LossSpec, plan: shard_pb2.StepPlan, after_optimizer_step: int,
                           optimizer_step: int, eval_mode: bool, hyperparameters: str = "",
                           gradient_scale: asyncio.Future | None = None,
                           loss_scale: float = 0.0) -> tuple[float, asyncio.Future]:
        """One planned step over this pipeline's Links: each micro-batch of `share` forward and backward on every
        stage in the plan's order, then optimizer step `optimizer_step`. Returns this share's loss once the last
        stage computed it, and a future of every stage's StageStats once the step settled."""
        forwards = [(shard_pb2.ForwardHeader(key=self.key(step, k), requires_grad=True, zero_grad=k == 0,
                                             after_optimizer_step=after_optimizer_step, eval_mode=eval_mode,
                                             plan=plan, data=piece.data(MAIN)),
                     None if piece.source else piece.x,
                     {name: piece.data(name) if piece.source else tensor for name, tensor in piece.inputs.items()})
                    for k, piece in enumerate(share)]
        targets = [(shard_pb2.LossTarget(key=self.key(step, k), loss=loss, rows=piece.rows, batch_rows=batch_rows,
                                         data=piece.data(TARGET) if piece.y is not None else None,
                                         loss_scale=loss_scale),
                    None if piece.source else piece.y) for k, piece in enumerate(share)]
        request = shard_pb2.StepRequest(deployment_id=self.deployment_id, step=step, optimizer_step=optimizer_step,
                                        backward_steps=[step], hyperparameters_json=hyperparameters)
        return await self._links.planned(forwards, targets, request, gradient_scale)

    async def forward(self, step: int, x: torch.Tensor, requires_grad: bool, zero_grad: bool,
                      after_optimizer_step: int, input_requires_grad: bool = False, eval_mode: bool = False,
                      inputs: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sends x (and the model's other inputs) into the first stage over the input Link; returns the last
        stage's output and the model's other outputs by name."""
        header = shard_pb2.ForwardHeader(key=self.key(step), requires_grad=requires_grad, zero_grad=zero_grad,
                                         after_optimizer_step=after_optimizer_step,
                                         input_requires_grad=input_requires_grad, eval_mode=eval_mode)
        return await self._links.forward(header, x.detach(), {k: v.detach() for k, v in (inputs or {}).items()})

    async def backward(self, step: int, grad: torch.Tensor | None, zero_grad: bool = False,
                       output_grads: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """Sends the gradients of the outputs into the last stage (each stage clearing its gradients first with
        `zero_grad`); returns once every stage has run backward, with the input's gradient if the forward asked."""
        return await self._links.backward(shard_pb2.BackwardHeader(key=self.key(step), zero_grad=zero_grad), grad,
                                          output_grads or {})

    def step_request(self, step: int, zero_grad: bool, optimizer_step: int,
                     backward_steps: Sequence[int]) -> shard_pb2.StepRequest:
        """An optimizer step, to send on its own or with the next forward."""
        return shard_pb2.StepRequest(deployment_id=self.deployment_id, step=step, zero_grad=zero_grad,
                                     optimizer_step=optimizer_step, backward_steps=backward_steps,
                                     backwards_end_with_step=True)

    def step(self, request: shard_pb2.StepRequest) -> asyncio.Future:
        """Sends an optimizer step down the stages; the future ends once every stage has applied it (or refused)."""
        return self._links.step(request)

    async def flush(self, wait: bool = True) -> None:
        """Makes sure every optimizer step sent so far is confirmed (asks the stages if no output did); without
        `wait`, only asks."""
        await self._links.flush(wait)

    async def read_state(self) -> dict[str, torch.Tensor]:
        """Every stage's weights, merged under the user's state-dict keys."""
        parts = await asyncio.gather(*(self.stage_state(index) for index in range(len(self.stages))))
        return {key: value for part in parts for key, value in part.items()}

    async def stage_state(self, index: int) -> dict[str, torch.Tensor]:
        """Stage `index`'s weights, under the user's state-dict keys."""
        request = shard_pb2.ReadStateRequest(deployment_id=self.deployment_id)
        return await wire.collect(self.stages[index].stream("ReadState", request))

    async def load_state(self, per_stage: Sequence[dict[str, torch.Tensor]]) -> None:
        """Sends each stage its share of a state dict."""
        header = shard_pb2.LoadStateHeader(deployment_id=self.deployment_id)
        await asyncio.gather(*(
            stage.call("LoadState", wire.framed(shard_pb2.LoadStateRequest, header, tensors))
            for stage, tensors in zip(self.stages, per_stage)))

    async def read_optimizer_state(self) -> list[optim.KeyedState]:
        """Every stage's optimizer state, keyed by parameter name."""
        return list(await asyncio.gather(*(self.stage_optimizer_state(index) for index in range(len(self.stages)))))

    async def stage_optimizer_state(self, index: int) -> optim.KeyedState:
        """Stage `index`'s optimizer state, keyed by parameter name."""
        request = shard_pb2.ReadStateRequest(deployment_id=self.deployment_id)
        reader = RequestReader(self.stages[index].stream("ReadOptimizerState", request))
        header = await reader.header()
        return optim.KeyedState.parse(header.layout, await reader.tensors())

    async def load_optimizer_state(self, per_stage: Sequence[optim.KeyedState], check_only: bool = False) -> None:
        """Replaces each stage's optimizer state with its share; with `check_only`, raises where a stage would not."""
        async def load(stage: Peer, state: optim.KeyedState) -> None:
            header = shard_pb2.OptimizerStateHeader(deployment_id=self.deployment_id, layout=state.layout(),
                                                    check_only=check_only)
            await stage.call("LoadOptimizerState", wire.framed(shard_pb2.OptimizerStateMessage, header, state.tensors))
        await asyncio.gather(*(load(stage, state) for stage, state in zip(self.stages, per_stage)))

    async def gradient_norms(self, backward_steps: Sequence[int], norm_type: float, optimizer_step: int,
                             edits: dict[int, list] | None = None) -> list[float]:
        """Each stage's gradient norm once the listed backwards are over there, for the optimizer step named,
        after its share of the gradient `edits` (per stage)."""
        answers = await self.gradient_norm_answers(backward_steps, norm_type, optimizer_step, edits or {}, {})
        return [answer.norm for answer in answers]

    async def gradient_norm_answers(self, backward_steps: Sequence[int], norm_type: float, optimizer_step: int,
                                    edits: dict[int, list], parameters: dict[int, list[str]]
                                    ) -> list[shard_pb2.GradientNormResponse]:
        """Each stage's GradientNorm answer, its `edits` applied first, with the norms of its `parameters`."""
        def request(index: int) -> shard_pb2.GradientNormRequest:
            return shard_pb2.GradientNormRequest(
                deployment_id=self.deployment_id, backward_steps=backward_steps, norm_type=norm_type,
                optimizer_step=optimizer_step, edits=edits.get(index, []), parameters=parameters.get(index, []))
        return list(await asyncio.gather(*(stage.call("GradientNorm", request(index))
                                           for index, stage in enumerate(self.stages))))

    async def describe(self) -> list[shard_pb2.DescribeResponse]:
        """What each stage's shard reports about itself."""
        return list(await asyncio.gather(*(s.call("Describe", shard_pb2.DescribeRequest()) for s in self.stages)))

    async def answering(self) -> list[bool]:
        """Per stage, whether its shard answers a Describe within the probe deadline."""
        async def answers(stage: Peer) -> bool:
            try:
                await stage.call("Describe", shard_pb2.DescribeRequest(), timeout=self.probe_timeout)
                return True
            except errors.ShardtrainError:
                return False
        return list(await asyncio.gather(*(answers(stage) for stage in self.stages)))

    async def silent_stages(self) -> str:
        """Which stages do not answer a Describe within the probe deadline (stopped, hung or gone), for the message
        of a wait that ran out: the stage a step waits on is often not the one that stopped."""
        answered = await self.answering()
        silent = [stage.name for stage, ok in zip(self.stages, answered) if not ok]
        if not silent:
            return "; every stage answers, so it is still working on it or an item was lost"
        return f"; {', '.join(silent)} did not answer within {self.probe_timeout:g} s (stopped, hung or gone)"

    async def close(self) -> None:
        """Closes every channel."""
        await self._links.close()
        await asyncio.gather(*(stage.close() for stage in self.stages))
        if self._segments is not None:
            self._segments.close()


def split_state(state: dict[str, torch.Tensor], owners: dict[str, list[int]], num_stages: int,
                strict: bool, optional: set[str] = frozenset()) -> list[dict[str, torch.Tensor]]:
    """Groups a state dict by the stages that hold each key (every one of them: a weight several stages read goes
    to each); InvalidArgument on unknown or (if strict) missing keys, `optional` ones aside."""
    unknown = sorted(set(state) - set(owners))
    missing = sorted(set(owners) - set(state) - optional)
    if unknown or (strict and missing):
        raise InvalidArgument(f"state dict does not match the model: unexpected keys {unknown[:10]}, "
                              f"missing keys {missing[:10]}")
    per_stage: list[dict[str, torch.Tensor]] = [{} for _ in range(num_stages)]
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        for stage in owners[key]:
            per_stage[stage][key] = value
    return per_stage
