# Makefile: the two set-up commands of ztrain, wrapping CMake.
#
#   make demo   install what is missing, build, run a small training job
#   make test   install what is missing, build, run every test (then the
#               unit tests again under ASan+UBSan, and each fuzz target
#               for 10 s on its committed corpus)
#
# Other targets: build, deps, test-asan (every test under the sanitizers),
# fuzz (each fuzz target for FUZZ_SECONDS, default 300), bench, clean,
# install (cmake --install into $(DESTDIR)$(PREFIX), PREFIX default
# /usr/local), deb (the ztrain .deb, prefix /usr, in $(BUILD)/).
# docs/deploy.md, "Install", says where each file goes.
BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 300
JOBS       ?= $(shell nproc)
TEST_JOBS  ?= $(JOBS)
CMAKE_ARGS ?=
PREFIX     ?= /usr/local
DESTDIR    ?=

.PHONY: all deps build build-asan build-fuzz test test-unit-asan test-asan test-fuzz fuzz demo \
	bench clean install deb

all: build

deps:
	bash deploy/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

build-asan: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DZT_SANITIZE=ON -DZT_WITH_CUDA=OFF $(CMAKE_ARGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# The libFuzzer targets (tests/fuzz), built with clang; and the CPU
# kernels, which none of them links, so that the code most particular to
# one compiler (OpenMP simd, vector intrinsics) compiles with clang too.
build-fuzz: deps
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DZT_FUZZ=ON -DZT_WITH_CUDA=OFF $(CMAKE_ARGS)
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_all zt_kernels

# ctest runs TEST_JOBS tests at a time (default: one per core). A test
# that keeps more than one core busy says so (its PROCESSORS), and the ones
# that need something alone hold a RESOURCE_LOCK (tests/CMakeLists.txt).
# The ten slowest tests are printed at the end, pass or fail.
CTEST = ctest -j $(TEST_JOBS) --output-on-failure
SLOWEST = python3 $(CURDIR)/tests/slowest

test: build
	cd $(BUILD) && { $(CTEST) --output-junit $(abspath $(BUILD))/ctest-junit.xml; rc=$$?; \
	  $(SLOWEST) $(abspath $(BUILD))/ctest-junit.xml 10; exit $$rc; }
	$(MAKE) test-unit-asan
	$(MAKE) test-fuzz

test-unit-asan: build-asan
	cd $(ASAN_BUILD) && $(CTEST) -L unit

test-asan: build-asan
	cd $(ASAN_BUILD) && $(CTEST)

test-fuzz: build-fuzz
	cd $(FUZZ_BUILD) && ZT_FUZZ_SECONDS=10 ctest -V -L fuzz

fuzz: build-fuzz
	cd $(FUZZ_BUILD) && ZT_FUZZ_SECONDS=$(FUZZ_SECONDS) ctest -V -L fuzz

demo: build
	bash examples/demo.sh $(BUILD)

bench: build
	bench/heartbeats $(BUILD)

install: build
	DESTDIR="$(DESTDIR)" cmake --install $(BUILD) --prefix "$(PREFIX)"

deb: build
	cd $(BUILD) && cpack -G DEB

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
