zt_unit_test(test_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm.c LIBS zt_comm)
