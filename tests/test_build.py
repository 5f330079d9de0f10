import torch

import indexcache


def test_build_info():
    info = indexcache.build_info()
    assert info["torch"] == torch.__version__
    assert info["built_with_torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda_kernels"], bool)
    if info["cuda_kernels"]:
        assert info["cuda_archs"], "CUDA kernels compiled but no architectures recorded"
        assert "release" in info["nvcc"]
        assert torch.version.cuda is not None
    assert info["cxx_compiler"]


def test_ops_registered():
    assert hasattr(torch.ops.indexcache, "fill_topk_buffer_")
