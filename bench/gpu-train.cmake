# bench/gpu-train.cmake: zt_gpubench, the model's training throughput on one
# GPU through the CUDA kernel table (run by bench/gpu-train next to PyTorch).
if(TARGET zt_kernels_cuda)
  add_executable(zt_gpubench ${CMAKE_CURRENT_SOURCE_DIR}/gpu_train.c)
  target_link_libraries(zt_gpubench PRIVATE zt_trainer zt_kernels_cuda m)
endif()
