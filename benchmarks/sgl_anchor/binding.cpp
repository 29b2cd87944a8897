// Python bindings for SGLang's transfer functions built from source (benchmarks/sgl_anchor/build.py).
// The declarations are sgl-kernel's public signatures (sgl_kernel.kvcacheio); the definitions come from
// SGLang's transfer.cu, compiled beside this file. hicache's bench calls them by these names.
#include <torch/extension.h>

using at::Tensor;

void transfer_kv_per_layer(const Tensor, Tensor, const Tensor, Tensor, const Tensor, const Tensor, int64_t, int64_t,
                           int64_t);
void transfer_kv_per_layer_pf_lf(const Tensor, Tensor, const Tensor, Tensor, const Tensor, const Tensor, int64_t,
                                 int64_t, int64_t, int64_t, int64_t);
void transfer_kv_all_layer(const Tensor, const Tensor, const Tensor, const Tensor, const Tensor, const Tensor, int64_t,
                           int64_t, int64_t, int64_t);
void transfer_kv_all_layer_lf_pf(const Tensor, Tensor, const Tensor, Tensor, const Tensor, const Tensor, int64_t,
                                 int64_t, int64_t, int64_t, int64_t);
void transfer_kv_per_layer_mla(const Tensor, Tensor, const Tensor, const Tensor, int64_t, int64_t, int64_t);
void transfer_kv_per_layer_mla_pf_lf(const Tensor, Tensor, const Tensor, const Tensor, int64_t, int64_t, int64_t,
                                     int64_t, int64_t);
void transfer_kv_all_layer_mla(const Tensor, const Tensor, const Tensor, const Tensor, int64_t, int64_t, int64_t,
                               int64_t);
void transfer_kv_all_layer_mla_lf_pf(const Tensor, Tensor, const Tensor, const Tensor, int64_t, int64_t, int64_t,
                                     int64_t, int64_t);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("transfer_kv_per_layer", &transfer_kv_per_layer);
  m.def("transfer_kv_per_layer_pf_lf", &transfer_kv_per_layer_pf_lf);
  m.def("transfer_kv_all_layer", &transfer_kv_all_layer);
  m.def("transfer_kv_all_layer_lf_pf", &transfer_kv_all_layer_lf_pf);
  m.def("transfer_kv_per_layer_mla", &transfer_kv_per_layer_mla);
  m.def("transfer_kv_per_layer_mla_pf_lf", &transfer_kv_per_layer_mla_pf_lf);
  m.def("transfer_kv_all_layer_mla", &transfer_kv_all_layer_mla);
  m.def("transfer_kv_all_layer_mla_lf_pf", &transfer_kv_all_layer_mla_lf_pf);
}
