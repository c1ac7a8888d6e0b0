# worker/zworker.cmake: the control client (library, shared with tests and
# benches) and the zworker daemon.
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_library(zt_control STATIC ${CMAKE_CURRENT_SOURCE_DIR}/control.c)
target_include_directories(zt_control PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_control PUBLIC zt_common zt_rpc zt_proto zt_pbcall)

add_executable(zworker ${CMAKE_CURRENT_SOURCE_DIR}/zworker.c ${CMAKE_CURRENT_SOURCE_DIR}/runner.c)
target_link_libraries(zworker PRIVATE zt_control zt_engine)
# zworker --device cuda:N loads the CUDA kernels at run time (worker/gpu.c):
# build them with it.
if(TARGET zt_kernels_cuda)
  add_dependencies(zworker zt_kernels_cuda)
  add_dependencies(zsolo zt_kernels_cuda)
endif()
