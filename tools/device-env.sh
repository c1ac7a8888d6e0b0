# tools/device-env.sh: source it on a GPU machine to build with packages
# unpacked from .deb files instead of installed (see tools/device-debs):
#
#   . tools/device-env.sh DEBDIR [ROOT]
#   cmake -S . -B build-gpu -DZT_GPU_ONLY=ON -DZT_CUDA_ARCHS=90 && cmake --build build-gpu -j
#
# It unpacks every DEBDIR/*.deb under ROOT (default /tmp/ztdeps) with
# dpkg -x and points pkg-config (with ROOT as sysroot, so the packages'
# /usr paths resolve under ROOT), the linker and the loader at it.
_zt_debs=${1:?usage: . tools/device-env.sh DEBDIR [ROOT]}
_zt_root=${2:-/tmp/ztdeps}
mkdir -p "$_zt_root"
for _zt_f in "$_zt_debs"/*.deb; do dpkg -x "$_zt_f" "$_zt_root"; done
_zt_lib=$_zt_root/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_SYSROOT_DIR=$_zt_root
export PKG_CONFIG_LIBDIR=$_zt_lib/pkgconfig:$_zt_lib/openblas-pthread/pkgconfig:$_zt_root/usr/share/pkgconfig
export LD_LIBRARY_PATH=$_zt_lib:$_zt_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LIBRARY_PATH=$_zt_lib:$_zt_lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}
unset _zt_debs _zt_root _zt_lib _zt_f
