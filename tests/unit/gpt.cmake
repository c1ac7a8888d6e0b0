zt_unit_test(test_gpt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_gpt.c LIBS zt_gpt)
