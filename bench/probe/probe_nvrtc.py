"""NVRTC and driver helpers shared by the probes in this folder (ctypes: the GPU machine has
PyTorch but no cargo). Import after torch has made its CUDA context."""
import ctypes

import torch


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: {rc}")


def compile_cubin(src, extra=()):
    """A cubin for this GPU's architecture from CUDA source `src` (C++17 and `extra` options);
    raises with NVRTC's log when it does not compile."""
    nvrtc = ctypes.CDLL("libnvrtc.so.13")
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"probe.cu", 0, None, None), "create")
    major, minor = torch.cuda.get_device_capability()
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17", *extra]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(log.value.decode())
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    check(nvrtc.nvrtcGetCUBIN(prog, buf), "cubin")
    return buf


def load(src, names, extra=()):
    """The driver library and `names` → function handle of `src` compiled and loaded."""
    cuda = ctypes.CDLL("libcuda.so.1")
    mod = ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(mod), compile_cubin(src, extra)), "load")
    funcs = {}
    for name in names:
        f = ctypes.c_void_p()
        check(cuda.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
        funcs[name] = f
    return cuda, funcs
