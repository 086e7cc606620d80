// The one Python binding of roberta_fast._C: declarations of the ops defined in
// their own files (one per op) and the PYBIND11_MODULE that exposes them.
#include <torch/extension.h>

#include <string>

namespace roberta_fast {

// Build facts, so Python can say what this extension was compiled with.
std::string version() { return "0.1.0"; }

bool built_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace roberta_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "roberta_fast C++/CUDA ops (fused Adam, dynamic masking)";
  m.def("version", &roberta_fast::version, "Version of the compiled extension.");
  m.def("built_with_cuda", &roberta_fast::built_with_cuda,
        "True when the CUDA implementations of the ops were compiled in.");
}
