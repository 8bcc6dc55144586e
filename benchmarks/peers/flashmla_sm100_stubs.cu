// FlashMLA's sm100 (Blackwell) entry points, for a build that compiles its sm90 kernels only
// (benchmarks/peers/build_flashmla.py). FlashMLA's API binds both architectures and picks
// one at run time; the sm100 sources need sm_100 targets, so these definitions stand in for
// them and raise if ever called (they cannot be on a Hopper GPU).
#include <stdexcept>

#include <ATen/Tensor.h>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/dense/interface.h"
#include "sm100/prefill/sparse/fwd/head128/phase1.h"
#include "sm100/prefill/sparse/fwd/head64/phase1.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

namespace {
[[noreturn]] void not_built() {
    throw std::runtime_error("FlashMLA was built for sm90 only (benchmarks/peers): no sm100 kernels");
}
}  // namespace

namespace sm100::decode::head64 {
template <ModelType MODEL_TYPE>
void run_flash_splitkv_mla_fp8_sparse_kernel(const SparseAttnDecodeParams &) { not_built(); }
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams &);
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams &);
}  // namespace sm100::decode::head64

namespace sm100::fwd_for_small_topk::head128 {
template <SparseAttnFwdMode FWD_MODE, int D_QK>
void run_fwd_for_small_topk_phase1_kernel(const SparseFwdArgT<FWD_MODE> &) { not_built(); }
template void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::Prefill, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::Prefill> &);
template void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV> &);
}  // namespace sm100::fwd_for_small_topk::head128

namespace sm100::fwd::head64 {
template <int D_QK>
void run_fwd_phase1_kernel(const SparseAttnFwdParams &) { not_built(); }
template void run_fwd_phase1_kernel<512>(const SparseAttnFwdParams &);
template void run_fwd_phase1_kernel<576>(const SparseAttnFwdParams &);
}  // namespace sm100::fwd::head64

namespace sm100::fwd::head128 {
template <int D_QK>
void run_fwd_phase1_kernel(const SparseAttnFwdParams &) { not_built(); }
template void run_fwd_phase1_kernel<512>(const SparseAttnFwdParams &);
template void run_fwd_phase1_kernel<576>(const SparseAttnFwdParams &);
}  // namespace sm100::fwd::head128

void FMHACutlassSM100FwdRun(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, at::Tensor, int, float, int, int, bool) {
    not_built();
}

void FMHACutlassSM100BwdRun(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, int, float, int, int, bool) {
    not_built();
}
