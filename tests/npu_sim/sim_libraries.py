"""The simulated CANN install of this subprocess (ASCEND_HOME_PATH and the generation x chip
that tests/test_npu_contract.py sets), loaded once for every check module, with the ctypes
signatures of the runtime-core calls the checks make straight into the simulator."""

import ctypes
import os

LIB64 = os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64")
CHIP, GEN = os.environ["JAX_ROPE_SIM_CHIP"], int(os.environ["JAX_ROPE_SIM_GEN"])
CORE = ctypes.CDLL(os.path.join(LIB64, "libascendcl.so"))  # the shared bookkeeping
OPS = ctypes.CDLL(os.path.join(LIB64, "libopapi.so" if GEN == 80 else "libopapi_transformer.so"))

_P, _I64, _U64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32
CORE.aclCreateTensor.restype = _P
CORE.aclCreateTensor.argtypes = [_P, _U64, _I32, _P, _I64, _I32, _P, _U64, _P]
CORE.aclDestroyTensor.argtypes = [_P]
CORE.aclCreateIntArray.restype = _P
CORE.aclCreateIntArray.argtypes = [_P, _U64]
CORE.aclDestroyIntArray.argtypes = [_P]
CORE.aclDestroyAclOpExecutor.argtypes = [_P]
CORE.aclGetRecentErrMsg.restype = ctypes.c_char_p
