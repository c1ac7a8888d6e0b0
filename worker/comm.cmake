# worker/comm.cmake: collectives (TCP ring; NCCL when CUDA is present).
if(ZT_GPU_ONLY) # needs the control-plane packages
  return()
endif()
add_library(zt_comm STATIC ${CMAKE_CURRENT_SOURCE_DIR}/comm_tcp.c)
target_include_directories(zt_comm PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_comm PUBLIC zt_common)
# The NCCL backend: compiled whenever CUDA and NCCL are found; the libraries
# are dlopen'ed at run time, so the same binaries run without a GPU.
if(ZT_HAVE_CUDA AND EXISTS /usr/local/cuda/include/nccl.h)
  target_sources(zt_comm PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/comm_nccl.c)
  target_include_directories(zt_comm PRIVATE /usr/local/cuda/include)
  target_compile_definitions(zt_comm PUBLIC ZT_HAVE_NCCL=1)
  target_link_libraries(zt_comm PUBLIC ${CMAKE_DL_LIBS})
else()
  target_sources(zt_comm PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/comm_nonccl.c)
endif()
