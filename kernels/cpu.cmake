# kernels/cpu.cmake: the CPU kernel tables (fast OpenMP + CBLAS, and the serial
# reference the unit tests compare it with).
#
# The fast kernels are compiled with -O3 so that the inner loops marked
# `omp simd` vectorize. ZT_NATIVE adds -march=native (FMA, AVX2/AVX-512 where
# the build machine has them); turn it off to build binaries for other CPUs.
option(ZT_NATIVE "Compile the CPU kernels for the build machine's CPU (-march=native)" ON)

add_library(zt_kernels_cpu STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/cpu/ref.c
  ${CMAKE_CURRENT_SOURCE_DIR}/cpu/fast.c)
target_include_directories(zt_kernels_cpu PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(zt_kernels_cpu PUBLIC zt_common PkgConfig::OPENBLAS OpenMP::OpenMP_C m)
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/cpu/fast.c PROPERTIES COMPILE_OPTIONS "-O3;-fno-math-errno;-ffp-contract=fast")
if(ZT_NATIVE)
  target_compile_options(zt_kernels_cpu PRIVATE -march=native)
endif()
