# bench/allreduce.cmake: one rank of a collective run (bench/allreduce, tests).
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_executable(zt_commrun ${CMAKE_CURRENT_SOURCE_DIR}/commrun.c)
target_link_libraries(zt_commrun PRIVATE zt_comm)
