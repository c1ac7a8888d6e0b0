# kernels/cuda.cmake: the CUDA kernel table (kernels/cuda/), built whenever
# nvcc is found under /usr/local/cuda, so CUDA code compiles in CI without a
# GPU. It is a shared library with the CUDA runtime linked statically and
# cuBLASLt dynamically; only code that runs on a GPU links or loads it, so
# the CPU binaries need no CUDA libraries at run time.
#
# Architectures: sm_80 (A100) and sm_90 (H100/H200) machine code;
# ZT_CUDA_ARCHS overrides (e.g. -DZT_CUDA_ARCHS=90 for a faster build).
if(ZT_HAVE_CUDA)
  find_package(CUDAToolkit REQUIRED)
  set(ZT_CUDA_ARCHS "80;90" CACHE STRING "CUDA architectures of the kernels")
  add_library(zt_kernels_cuda SHARED ${CMAKE_CURRENT_SOURCE_DIR}/cuda/kernels.cu)
  set_target_properties(zt_kernels_cuda PROPERTIES
    CUDA_ARCHITECTURES "${ZT_CUDA_ARCHS}"
    CUDA_RUNTIME_LIBRARY Static
    CUDA_STANDARD 17
    LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib)
  target_include_directories(zt_kernels_cuda PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}
                             ${CMAKE_CURRENT_SOURCE_DIR}/cuda)
  target_compile_options(zt_kernels_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
  target_link_libraries(zt_kernels_cuda PRIVATE CUDA::cublasLt)
endif()
