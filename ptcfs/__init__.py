"""ptcfs: parallelizable tensor collections for elastic deep-learning jobs.

The core library: the PTC types, sharding rules, model presets, the
reconfiguration planner, model spec files and the tensor store. It needs neither torch nor
ZeroMQ.
"""

from ptcfs.errors import (
    InvalidConfig,
    InvalidRequest,
    JobNotFound,
    PtcError,
    TensorNotFound,
    VersionImmutable,
    VersionNotFound,
)
from ptcfs.model.llama import llama, moe
from ptcfs.model.modelkit import with_optimizer
from ptcfs.model.presets import gpt, parse_model
from ptcfs.model.specfile import (
    decode_spec,
    dump_spec,
    encode_spec,
    load_spec_file,
    spec_from_dict,
    spec_to_dict,
)
from ptcfs.plan.planner import plan
from ptcfs.sharding import parse_config, rank_coords, rank_tensors, validate
from ptcfs.types import (
    Endpoint,
    Host,
    ModelSpec,
    ParallelConfig,
    Plan,
    ShardRule,
    Slice,
    TensorSpec,
    Transfer,
)

__version__ = "0.1.0"

__all__ = [
    "Endpoint",
    "Host",
    "InvalidConfig",
    "InvalidRequest",
    "JobNotFound",
    "ModelSpec",
    "ParallelConfig",
    "Plan",
    "PtcError",
    "ShardRule",
    "Slice",
    "TensorNotFound",
    "TensorSpec",
    "Transfer",
    "VersionImmutable",
    "VersionNotFound",
    "decode_spec",
    "dump_spec",
    "encode_spec",
    "gpt",
    "llama",
    "load_spec_file",
    "moe",
    "parse_config",
    "parse_model",
    "plan",
    "rank_coords",
    "rank_tensors",
    "spec_from_dict",
    "spec_to_dict",
    "validate",
    "with_optimizer",
]
