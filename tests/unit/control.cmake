zt_unit_test(test_common SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_common.c)
zt_unit_test(test_state SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_state.c LIBS zt_state)
