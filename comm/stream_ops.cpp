#include "comm/stream_ops.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/errors.h"

namespace ddpdiag::host_ops {

namespace {

bool is_16bit_float(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }

bool is_float(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || is_16bit_float(t);
}


template <std::uint16_t (*To)(float), float (*From)(std::uint16_t)>
void compress_as(const void* src, DType src_type, std::uint16_t* dst, std::size_t n, int divisor) {
  const float w = static_cast<float>(divisor);
  if (src_type == DType::kFloat32) {
    const auto* s = static_cast<const float*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = To(From(To(s[i])) / w);
    return;
  }
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = To(From(To(static_cast<float>(load_as_double(src_type, src, i)))) / w);
}

template <float (*From)(std::uint16_t)>
void decompress_as(const std::uint16_t* src, DType dst_type, void* dst, std::size_t n) {
  if (dst_type == DType::kFloat32) {
    auto* d = static_cast<float*>(dst);
    for (std::size_t i = 0; i < n; ++i) d[i] = From(src[i]);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) store_from_double(dst_type, dst, i, From(src[i]));
}

}  // namespace

void check_compress_types(const char* what, DType floating, DType sixteen) {
  if (!is_float(floating) || !is_16bit_float(sixteen))
    throw UsageError(std::string(what) + ": needs a floating-point tensor and a 16-bit float type, "
                         "got " + std::string(dtype_name(floating)) + " and " +
                         std::string(dtype_name(sixteen)),
                     ErrorContext{what, -1, -1, "compression hooks apply to floating-point buckets"});
}

void check_pieces(std::uint64_t flat_bytes, std::span<const FlatPiece> pieces) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  ranges.reserve(pieces.size());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    if (p.offset > flat_bytes || p.bytes > flat_bytes - p.offset)
      throw UsageError("flat copy plan: piece " + std::to_string(i) + " [" +
                           std::to_string(p.offset) + ", +" + std::to_string(p.bytes) +
                           ") lies outside the flat buffer of " + std::to_string(flat_bytes) +
                           " bytes",
                       ErrorContext{"stream_ops.plan", -1, -1, "pieces must fit in the bucket"});
    if (p.bytes && !p.ptr)
      throw UsageError("flat copy plan: piece " + std::to_string(i) + " has no buffer",
                       ErrorContext{"stream_ops.plan", -1, -1, "give every piece its buffer"});
    if (p.bytes) ranges.emplace_back(p.offset, p.offset + p.bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      throw UsageError("flat copy plan: pieces overlap at byte " + std::to_string(ranges[i].first),
                       ErrorContext{"stream_ops.plan", -1, -1, "give pieces disjoint offsets"});
}

void flatten(void* flat, std::span<const FlatPiece> pieces) {
  auto* base = static_cast<std::uint8_t*>(flat);
  for (const auto& p : pieces)
    if (p.bytes && base + p.offset != p.ptr) std::memcpy(base + p.offset, p.ptr, p.bytes);
}

void unflatten(const void* flat, std::span<const FlatPiece> pieces) {
  const auto* base = static_cast<const std::uint8_t*>(flat);
  for (const auto& p : pieces)
    if (p.bytes && base + p.offset != p.ptr) std::memcpy(p.ptr, base + p.offset, p.bytes);
}

void divide(void* buf, std::size_t n, DType t, int divisor) {
  if (t == DType::kFloat32) {
    const float w = static_cast<float>(divisor);
    auto* p = static_cast<float*>(buf);
    for (std::size_t i = 0; i < n; ++i) p[i] = p[i] / w;
    return;
  }
  divide_host(t, buf, n, divisor);
}

void compress(const void* src, DType src_type, void* dst16, DType dst_type, std::size_t n,
              int divisor) {
  check_compress_types("compress", src_type, dst_type);
  auto* d = static_cast<std::uint16_t*>(dst16);
  if (dst_type == DType::kFloat16)
    compress_as<float_to_half, half_to_float>(src, src_type, d, n, divisor);
  else
    compress_as<float_to_bfloat16, bfloat16_to_float>(src, src_type, d, n, divisor);
}

void decompress(const void* src16, DType src_type, void* dst, DType dst_type, std::size_t n) {
  check_compress_types("decompress", dst_type, src_type);
  const auto* s = static_cast<const std::uint16_t*>(src16);
  if (src_type == DType::kFloat16)
    decompress_as<half_to_float>(s, dst_type, dst, n);
  else
    decompress_as<bfloat16_to_float>(s, dst_type, dst, n);
}

}  // namespace ddpdiag::host_ops
