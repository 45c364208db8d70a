# Shell helpers shared by gpu_bench.sh and moe_gpu_bench.sh (sourced, from the repository root).

# find_lib NAME: the path of a shared library on the device machine ("" when none)
find_lib() {
  local d f
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/$1" ] && { echo "$d/$1"; return; }
  done
  f=$(timeout 20 find /opt /usr/local /usr/lib /usr/lib64 -name "$1" 2>/dev/null | head -1)
  [ -z "$f" ] && f=$(timeout 40 find / -name "$1" -not -path '/proc/*' -not -path '/sys/*' 2>/dev/null | head -1)
  echo "$f"
}

# the driver's libcuda.so.1 (not the toolkit's forward-compatibility copy): the prebuilt libggml-cuda.so
# calls the driver API (cuMemCreate, ...) without naming libcuda as a dependency (it was linked against a
# stub), so it is preloaded for llama.cpp's commands (session 8: "undefined symbol: cuMemCreate")
driver_libcuda() {
  local d
  for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64; do
    [ -e "$d/libcuda.so.1" ] && { echo "$d/libcuda.so.1"; return; }
  done
  ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}'
}
