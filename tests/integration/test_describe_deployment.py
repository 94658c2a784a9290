"""The coordinator describes the deployment it shipped last to any client: where each stage of each replica runs,
and the model's inputs and outputs as its captured graphs take and give them."""

from __future__ import annotations

import pytest
import torch

from client_sdk import Cluster, TensorInfo
from shardtrain.errors import NotFound
from tests.integration.test_whole_models import gpt, token_batches


def test_another_client_learns_the_stages_and_the_models_inputs_and_outputs():
    with Cluster.local(num_shards=4) as cluster:
        observer = Cluster.connect(cluster.address, cluster.security)  # a second client, which deploys nothing
        with pytest.raises(NotFound, match="nothing has been deployed"):
            observer.deployment()
        model = cluster.deploy(gpt(), optimizer=(torch.optim.AdamW, {"lr": 1e-3}), example_inputs=token_batches(1)[0],
                               num_stages=2, replicas=2)
        seen = observer.deployment()
        assert seen.deployment_id == model.deployment_id and (seen.num_stages, seen.replicas) == (2, 2)
        assert seen.stages == tuple(tuple(stage.address for stage in clients.stages)
                                    for clients in model._trainer.replicas)
        assert seen.inputs == (TensorInfo("input", "int64", (None, 12)), TensorInfo("targets", "int64", (None, 12)))
        assert seen.outputs[0] == TensorInfo("output", "float32", (None, 12, 13))
        assert [(o.dtype, o.shape) for o in seen.outputs[1:]] == [("float32", ())]  # the loss
        with torch.no_grad():
            logits, loss = model(*token_batches(1, batch=3)[0])  # what the description says it returns
        assert logits.shape == (3, 12, 13) and loss.shape == ()
        observer.close()
