#!/usr/bin/env bash
# Makes a prebuilt bundle for scripts/gpu-check.sh, for a GPU machine that has
# CUDA, a driver and an NCCL (libnccl.so.2) but none of ddpdiag's other
# dependencies and no compiler set-up for them. Builds ddpdiag, ddpdiag_tests
# and ddpdiag_bench_device with CUDA from this tree and writes into DIR:
#   bin/           stripped copies of the three programs
#   lib/           every shared library they need except glibc's own
#                  (libc, libm, libdl, libpthread, librt, ld-linux...), the
#                  CUDA driver and NCCL, which come from the GPU machine, and
#                  the C++ runtime:
#   cxxrt/         libstdc++.so.6 and libgcc_s.so.1, apart: they may need a
#                  newer glibc than the rest, and gpu-check.sh falls back to
#                  the GPU machine's own when they cannot load there
#   glibc-needed.txt  the highest GLIBC_x.y symbol version any file needs
#                  (first line), the same without cxxrt/, and each file's
#   MANIFEST.txt   each file's size and sha256, the commit built, whether
#                  the tree had changes on top of it, and the hash of the
#                  sources built (scripts/source-hash.sh), which gpu-check.sh
#                  compares with the tree it runs in
# Then copy the tree with DIR to the GPU machine (.gpu-bundle/ is git-ignored:
# a copy of the tracked files alone leaves it behind, so name it explicitly)
# and run there: scripts/gpu-check.sh OUT_DIR (it finds .gpu-bundle/ itself;
# BUNDLE_DIR=DIR for another folder). Without a bundle gpu-check.sh can only
# build, which a GPU machine without ddpdiag's dependencies cannot.
# BUILD_DIR (default build-gpu) is the build tree used: configured here
# (Release, CUDA on, no CPU benchmarks) if it has no CMakeCache.txt yet,
# otherwise only brought up to date; it must be a CUDA build of this tree.
# JOBS (default: nproc) is the build's parallelism.
# Usage: scripts/gpu-bundle.sh [DIR]   (DIR defaults to .gpu-bundle)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"
dir="${1:-.gpu-bundle}"
build="${BUILD_DIR:-build-gpu}"
jobs="${JOBS:-$(nproc)}"
max_mib=56
glibc_ceiling=2.35  # the oldest glibc a GPU machine is assumed to have
targets=(ddpdiag ddpdiag_tests ddpdiag_bench_device)
declare -A target_path=([ddpdiag]=diag/ddpdiag [ddpdiag_tests]=tests/ddpdiag_tests
                        [ddpdiag_bench_device]=bench/ddpdiag_bench_device)

die() { echo "gpu-bundle: $*" >&2; exit 1; }
for tool in cmake ldd objdump readelf strip sha256sum git; do
  command -v "$tool" >/dev/null || die "$tool is needed"
done

# 1. Build. The sources' hash is taken before and checked after: a bundle
# must be built from the sources its manifest names.
sources="$(scripts/source-hash.sh)"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDPDIAG_WITH_CUDA=ON \
    -DDDPDIAG_BUILD_BENCH=OFF
fi
src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")"
[ "$(cd "$src" 2>/dev/null && pwd -P)" = "$(pwd -P)" ] ||
  die "$build is a build of '$src', not of $root; set BUILD_DIR to a build of this tree"
cmake --build "$build" -j"$jobs" --target "${targets[@]}"
build_type="$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$build/CMakeCache.txt")"

# 2. Copy and strip the programs; each must be a CUDA build (needs libnccl).
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/MANIFEST.txt" ]; then
  die "$dir exists and is not a bundle: not overwriting it"
fi
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/lib" "$dir/cxxrt"
dir_abs="$(cd "$dir" && pwd)"
for t in "${targets[@]}"; do
  f="$build/${target_path[$t]}"
  [ -x "$f" ] || die "$f was not built"
  readelf -d "$f" | grep -q 'NEEDED.*\[libnccl\.so' ||
    die "$f does not use NCCL: $build is not a CUDA build (configure it with -DDDPDIAG_WITH_CUDA=ON)"
  cp "$f" "$dir/bin/$t"
  strip --strip-all "$dir/bin/$t"
done

# 3. The shared libraries they need, by the name they are asked for (SONAME).
# Left out: glibc's libraries and loader, the vDSO, the CUDA driver, NCCL.
skip='^(linux-vdso\.so|linux-gate\.so|ld-linux.*|libc\.so|libm\.so|libmvec\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libutil\.so|libanl\.so|libnsl\.so|libnss_.*|libBrokenLocale\.so|libthread_db\.so|libc_malloc_debug\.so|libcuda\.so|libnvidia-.*|libnccl\.so)'
ldd_all="$(for t in "${targets[@]}"; do ldd "$dir/bin/$t"; done)"
if grep -q 'not found' <<<"$ldd_all"; then
  grep 'not found' <<<"$ldd_all" >&2
  die "some libraries are not found on this machine"
fi
while read -r name _ path _; do
  [[ "$name" =~ $skip ]] && continue
  [ -f "$path" ] || die "cannot resolve $name (ldd: '$path')"
  to=lib
  [[ "$name" =~ ^(libstdc\+\+|libgcc_s)\.so ]] && to=cxxrt
  [ -e "$dir/$to/$name" ] && continue
  cp -L "$path" "$dir/$to/$name"
  chmod u+w "$dir/$to/$name"
  strip --strip-unneeded "$dir/$to/$name"
done < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $2, $3}' <<<"$ldd_all" | sort -u)
compgen -G "$dir/lib/libcudart.so.*" >/dev/null ||
  echo "gpu-bundle: note: no shared libcudart needed (linked statically)"

# 4. The self-check: every library resolves from the bundle, glibc's and
# NCCL's aside, and the program starts.
nccl_dir="$(dirname "$(ldd "$dir/bin/ddpdiag" | awk '$1 ~ /^libnccl\.so/ {print $3; exit}')")"
check="$(LD_LIBRARY_PATH="$dir_abs/lib:$dir_abs/cxxrt:$nccl_dir" ldd "$dir/bin/"* 2>&1)"
bad="$(awk -v lib="$dir_abs/lib/" -v cxx="$dir_abs/cxxrt/" '$2 == "=>" &&
        $1 !~ /^(libc|libm|libdl|libpthread|librt|libnccl)\.so/ &&
        index($3, lib) != 1 && index($3, cxx) != 1 {print}' <<<"$check" | sort -u)"
[ -z "$bad" ] || { echo "$bad" >&2; die "these libraries do not resolve from $dir"; }
for path in "$dir_abs/lib:$dir_abs/cxxrt:$nccl_dir" "$dir_abs/lib:$nccl_dir"; do
  env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$path" "$dir/bin/ddpdiag" --version >/dev/null ||
    die "$dir/bin/ddpdiag does not start with LD_LIBRARY_PATH=$path"
done

# 5. The newest glibc symbol version any file needs.
{
  echo "# highest GLIBC_ symbol version each bundled file needs"
  for f in "$dir"/bin/* "$dir"/lib/* "$dir"/cxxrt/*; do
    v="$(objdump -T "$f" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n1 || true)"
    echo "${v:-none} ${f#"$dir"/}"
  done
} >"$dir/glibc-needed.tmp"
need="$(grep -v '^#' "$dir/glibc-needed.tmp" | awk '$1 != "none" {print $1}' | sort -uV | tail -n1)"
need_rest="$(grep -v -e '^#' -e ' cxxrt/' "$dir/glibc-needed.tmp" | awk '$1 != "none" {print $1}' |
             sort -uV | tail -n1)"
{
  echo "GLIBC_$need"
  echo "# GLIBC_$need_rest with the machine's own libstdc++ and libgcc_s instead of cxxrt/"
  cat "$dir/glibc-needed.tmp"
} >"$dir/glibc-needed.txt"
rm -f "$dir/glibc-needed.tmp"

# 6. The manifest.
commit="$(git rev-parse HEAD)"
[ "$(scripts/source-hash.sh)" = "$sources" ] ||
  die "the sources changed while the bundle was built; run it again"
changes="$(git status --short)"
{
  echo "ddpdiag GPU bundle"
  echo "commit: $commit"
  if [ -n "$changes" ]; then
    echo "dirty: yes (built from the working tree, with these changes on top of the commit)"
    while IFS= read -r line; do echo "  $line"; done <<<"$changes"
  else
    echo "dirty: no"
  fi
  echo "sources: $sources"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), build type ${build_type:-unset}"
  echo "glibc needed: GLIBC_$need (GLIBC_$need_rest without cxxrt/)"
  echo "files (bytes sha256 path):"
  (cd "$dir" && find bin lib cxxrt glibc-needed.txt -type f | LC_ALL=C sort |
     while read -r f; do echo "$(stat -c %s "$f") $(sha256sum "$f" | cut -d' ' -f1) $f"; done)
} >"$dir/MANIFEST.txt"

# 7. Report.
bytes="$(du -sb "$dir" | cut -f1)"
mib="$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')"
progs=("$dir"/bin/*) libs=("$dir"/lib/* "$dir"/cxxrt/*)
echo "gpu-bundle: $dir: $mib MiB, ${#progs[@]} programs, ${#libs[@]} libraries (${libs[*]##*/})"
echo "gpu-bundle: glibc needed: GLIBC_$need (by $(awk -v n="$need" '$1 == n {print $2}' "$dir/glibc-needed.txt" | tr '\n' ' '))"
newer() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n1)" != "$2" ]; }  # newer A B: A > B
if newer "$need_rest" "$glibc_ceiling"; then
  echo "gpu-bundle: WARNING: needs GLIBC_$need_rest even without cxxrt/, newer than $glibc_ceiling: a GPU machine with an older glibc cannot run it"
elif newer "$need" "$glibc_ceiling"; then
  echo "gpu-bundle: note: cxxrt/ needs GLIBC_$need, newer than $glibc_ceiling; on an older glibc gpu-check.sh uses the machine's own libstdc++ and libgcc_s (they must provide $(objdump -T "$dir"/bin/* | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -n1)), and the rest needs GLIBC_$need_rest"
fi
[ -z "$changes" ] || echo "gpu-bundle: note: built from a tree with uncommitted changes (listed in MANIFEST.txt)"
if [ "$bytes" -gt $((max_mib * 1048576)) ]; then
  die "$dir is $mib MiB, over the $max_mib MiB limit"
fi
