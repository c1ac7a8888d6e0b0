# common/rpc: the gRPC core wrapper (the only code that includes grpc headers).
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_library(zt_rpc STATIC ${CMAKE_CURRENT_SOURCE_DIR}/rpc.c)
target_include_directories(zt_rpc PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_rpc PUBLIC zt_common PkgConfig::UV PRIVATE PkgConfig::GRPC)
