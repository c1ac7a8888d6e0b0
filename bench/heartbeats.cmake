# bench/heartbeats.cmake: load generator behind bench/heartbeats.
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_executable(zt_hbload ${CMAKE_CURRENT_SOURCE_DIR}/hbload.c)
target_link_libraries(zt_hbload PRIVATE zt_common zt_rpc zt_proto)
