"""shardtrain's Python SDK: deploy a model over shard servers and train it with a plain PyTorch loop."""

from client_sdk.cluster import Cluster
from client_sdk.data_source import DataSource, RowBatch
from client_sdk.fit import History, StepRecord
from client_sdk.layer_list import LayerList
from client_sdk.gradients import RemoteGradient
from client_sdk.model import DistributedModel, Placement, RemoteParameter
from client_sdk.reports import DeploymentReport, ShardInfo, ShardReport, Table, TensorInfo
from client_sdk.timeline import Span, Timeline

__all__ = ["Cluster", "DataSource", "DeploymentReport", "DistributedModel", "History", "LayerList", "Placement",
           "RemoteGradient", "RemoteParameter", "RowBatch", "ShardInfo", "ShardReport", "Span", "StepRecord", "Table",
           "TensorInfo", "Timeline"]
