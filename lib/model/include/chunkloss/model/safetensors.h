// The safetensors format (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then
// the raw little-endian tensor bytes. A strict reader and an atomic writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "chunkloss/core/tensor.h"

namespace chunkloss::model {

/// One tensor entry of a safetensors header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;                ///< "F32", "BF16", "I64", ... as written in the file
  std::vector<std::int64_t> shape;  ///< [] for a scalar
  std::size_t begin = 0, end = 0;   ///< byte range in the data section
};

/// A safetensors file held in memory and validated on construction.
class SafetensorsFile {
 public:
  /// Reads and validates a file. Throws chunkloss::Error naming the path and the problem:
  /// cannot open, truncated file (shorter than 8 bytes or than its header length says), header
  /// length over 100 MB, bad header JSON (a key repeated in one object, e.g. a tensor named
  /// twice, or a NUL byte, included), header not an object, an entry without a string
  /// "dtype", an unknown dtype, a bad "shape" or "data_offsets", offsets out of range or not
  /// matching dtype x shape, tensors that overlap or leave holes in the data section, or a
  /// "__metadata__" that is not a string-to-string object.
  static SafetensorsFile read(const std::string& path);
  /// The same over bytes in memory; `source` names them in messages.
  static SafetensorsFile parse(std::string bytes, std::string source);

  const std::string& source() const { return source_; }
  /// Entries in data-offset order.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  /// nullptr when absent.
  const SafetensorsEntry* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The raw bytes of an entry of this file.
  std::span<const std::byte> data(const SafetensorsEntry& entry) const;
  /// Copies an entry into `out` as f32. Throws chunkloss::Error when its dtype is not F32 or
  /// its element count differs from out.size().
  void copy_f32(const SafetensorsEntry& entry, std::span<float> out) const;

 private:
  std::string source_;
  std::string bytes_;
  std::size_t data_start_ = 0;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// Bytes per element of a safetensors dtype name; 0 for an unknown name.
std::size_t safetensors_dtype_size(std::string_view dtype);

/// A tensor to write: a name and a host view (f32, bf16, i32 or i64).
struct NamedTensor {
  std::string name;
  TensorView view;
};

/// The file's bytes: tensors in the given order, the header padded with spaces to a multiple
/// of 8 bytes (so the data section is 8-byte aligned). Throws chunkloss::Error for a duplicate
/// or empty name, the reserved name "__metadata__", or a non-host view.
std::string serialize_safetensors(std::span<const NamedTensor> tensors,
                                  const std::map<std::string, std::string>& metadata = {});

/// serialize_safetensors() written atomically to `path` (see write_file_atomically).
void write_safetensors(const std::string& path, std::span<const NamedTensor> tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Writes `bytes` to `path` + ".tmp" in the same directory, fsyncs it, renames it over `path`
/// and fsyncs the directory: readers see the old file or the new one, never a partial one.
/// Throws chunkloss::Error naming the path and the failing call; on failure the temporary file
/// is removed and `path` is untouched.
void write_file_atomically(const std::string& path, std::string_view bytes);

}  // namespace chunkloss::model
