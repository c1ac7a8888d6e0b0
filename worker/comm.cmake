# worker/comm.cmake: collectives (TCP ring; NCCL when CUDA is present).
add_library(zt_comm STATIC ${CMAKE_CURRENT_SOURCE_DIR}/comm_tcp.c)
target_include_directories(zt_comm PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_comm PUBLIC zt_common)
