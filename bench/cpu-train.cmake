# bench/cpu-train.cmake: sgemm throughput reference for bench/cpu-train.
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_executable(zt_bench_sgemm ${CMAKE_CURRENT_SOURCE_DIR}/sgemm.c)
target_link_libraries(zt_bench_sgemm PRIVATE zt_kernels_cpu)
