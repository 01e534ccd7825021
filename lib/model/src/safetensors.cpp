// safetensors reading (every header field and offset validated before any data is touched) and
// writing (header padded to 8 bytes, tensors packed in order).
#include "chunkloss/model/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "atomic_file.h"
#include "chunkloss/core/error.h"
#include "chunkloss/core/strict_json.h"

namespace chunkloss::model {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

namespace {

using nlohmann::json;

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

const char* dtype_tag(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
  }
  return "?";
}

// A non-negative integer JSON value that fits in 63 bits, or an error.
std::uint64_t index_value(const json& v, const std::string& src, const std::string& name,
                          const char* what) {
  CHUNKLOSS_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0),
                  src, ": tensor \"", name, "\": ", what, " must hold non-negative integers, got ",
                  v.dump());
  const std::uint64_t u = v.get<std::uint64_t>();
  CHUNKLOSS_CHECK(u <= static_cast<std::uint64_t>(INT64_MAX), src, ": tensor \"", name,
                  "\": ", what, " value ", u, " is too large");
  return u;
}

// The header length from a file's first bytes (at least 9 of them, or all), checked against the
// file's size and the limit, the header's first byte a '{'.
std::uint64_t header_length(std::string_view first, std::uint64_t size, const std::string& src) {
  CHUNKLOSS_CHECK(size >= 8, src, ": truncated file: ", size,
                  " bytes, shorter than the 8-byte header length");
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, first.data(), 8);
  CHUNKLOSS_CHECK(header_len <= kMaxHeaderBytes, src, ": header length ", header_len,
                  " exceeds the 100 MB limit (not a safetensors file?)");
  CHUNKLOSS_CHECK(header_len <= size - 8, src, ": truncated file: the header length says ",
                  header_len, " bytes but only ", size - 8, " follow");
  CHUNKLOSS_CHECK(header_len > 0 && first[8] == '{', src,
                  ": bad header JSON: the header must start with '{'");
  return header_len;
}

}  // namespace

std::size_t safetensors_dtype_size(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  // The header's length against the file's size before the rest is read.
  std::string bytes = detail::read_regular_file(
      path, 9,
      [&](std::string_view first, std::uint64_t size) { header_length(first, size, path); });
  return parse(std::move(bytes), path);
}

SafetensorsFile SafetensorsFile::parse(std::string bytes, std::string source) {
  SafetensorsFile file;
  file.source_ = std::move(source);
  file.bytes_ = std::move(bytes);
  const std::string& src = file.source_;
  const std::size_t size = file.bytes_.size();
  const std::uint64_t header_len = header_length(file.bytes_, size, src);
  file.data_start_ = 8 + static_cast<std::size_t>(header_len);
  const std::size_t data_size = size - file.data_start_;

  const json header = chunkloss::detail::parse_strict_json(
      std::string_view(file.bytes_).substr(8, static_cast<std::size_t>(header_len)),
      src + ": bad header JSON");
  CHUNKLOSS_CHECK(header.is_object(), src, ": bad header JSON: expected an object, got ",
                  header.type_name());

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      CHUNKLOSS_CHECK(v.is_object(), src, ": \"__metadata__\" must be an object, got ",
                      v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        CHUNKLOSS_CHECK(m.value().is_string(), src, ": \"__metadata__\" value of \"", m.key(),
                        "\" must be a string, got ", m.value().type_name());
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    CHUNKLOSS_CHECK(v.is_object(), src, ": tensor \"", name, "\": entry must be an object, got ",
                    v.type_name());
    SafetensorsEntry e;
    e.name = name;
    const auto dt = v.find("dtype");
    CHUNKLOSS_CHECK(dt != v.end() && dt->is_string(), src, ": tensor \"", name,
                    "\": missing string field \"dtype\"");
    e.dtype = dt->get<std::string>();
    const std::size_t esize = safetensors_dtype_size(e.dtype);
    CHUNKLOSS_CHECK(esize > 0, src, ": tensor \"", name, "\": unknown dtype \"", e.dtype, "\"");
    const auto sh = v.find("shape");
    CHUNKLOSS_CHECK(sh != v.end() && sh->is_array(), src, ": tensor \"", name,
                    "\": missing array field \"shape\"");
    std::uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : *sh) {
      const std::uint64_t s = index_value(d, src, name, "shape");
      e.shape.push_back(static_cast<std::int64_t>(s));
      if (s != 0 && numel > UINT64_MAX / s) overflow = true;
      numel *= s;
    }
    CHUNKLOSS_CHECK(!overflow && numel <= UINT64_MAX / esize, src, ": tensor \"", name,
                    "\": shape ", shape_str(e.shape), " is too large");
    const auto off = v.find("data_offsets");
    CHUNKLOSS_CHECK(off != v.end() && off->is_array() && off->size() == 2, src, ": tensor \"", name,
                    "\": \"data_offsets\" must be [begin, end]");
    const std::uint64_t begin = index_value((*off)[0], src, name, "data_offsets");
    const std::uint64_t end = index_value((*off)[1], src, name, "data_offsets");
    CHUNKLOSS_CHECK(begin <= end, src, ": tensor \"", name, "\": data_offsets [", begin, ", ", end,
                    "] end before begin");
    CHUNKLOSS_CHECK(end <= data_size, src, ": tensor \"", name, "\": data_offsets [", begin, ", ",
                    end, "] out of range: the data section has ", data_size,
                    " bytes (truncated file?)");
    CHUNKLOSS_CHECK(end - begin == numel * esize, src, ": tensor \"", name, "\": data_offsets [",
                    begin, ", ", end, "] span ", end - begin, " bytes but ", e.dtype, " ",
                    shape_str(e.shape), " needs ", numel * esize);
    e.begin = static_cast<std::size_t>(begin);
    e.end = static_cast<std::size_t>(end);
    file.tensors_.push_back(std::move(e));
  }

  std::stable_sort(file.tensors_.begin(), file.tensors_.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  std::size_t expected = 0;
  for (const SafetensorsEntry& e : file.tensors_) {
    CHUNKLOSS_CHECK(e.begin >= expected, src, ": tensor \"", e.name, "\": data_offsets [", e.begin,
                    ", ", e.end, "] overlap the previous tensor (ends at ", expected, ")");
    CHUNKLOSS_CHECK(e.begin == expected, src, ": tensor \"", e.name, "\": data_offsets [", e.begin,
                    ", ", e.end, "] leave a hole after byte ", expected);
    expected = e.end;
  }
  CHUNKLOSS_CHECK(expected == data_size, src, ": the data section has ", data_size,
                  " bytes but the tensors cover ", expected, " (trailing bytes)");
  return file;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  for (const SafetensorsEntry& e : tensors_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::span<const std::byte> SafetensorsFile::data(const SafetensorsEntry& e) const {
  return {reinterpret_cast<const std::byte*>(bytes_.data()) + data_start_ + e.begin,
          e.end - e.begin};
}

void SafetensorsFile::copy_f32(const SafetensorsEntry& e, std::span<float> out) const {
  CHUNKLOSS_CHECK(e.dtype == "F32", source_, ": tensor \"", e.name, "\" has dtype ", e.dtype,
                  ", expected F32");
  CHUNKLOSS_CHECK((e.end - e.begin) == out.size() * sizeof(float), source_, ": tensor \"", e.name,
                  "\" holds ", (e.end - e.begin) / 4, " values, expected ", out.size());
  if (!out.empty()) std::memcpy(out.data(), data(e).data(), out.size() * sizeof(float));
}

std::string serialize_safetensors(std::span<const NamedTensor> tensors,
                                  const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> seen;
  std::size_t offset = 0;
  for (const NamedTensor& t : tensors) {
    CHUNKLOSS_CHECK(!t.name.empty() && t.name != "__metadata__", "serialize_safetensors: bad ",
                    "tensor name \"", t.name, "\"");
    CHUNKLOSS_CHECK(seen.insert(t.name).second, "serialize_safetensors: duplicate tensor name \"",
                    t.name, "\"");
    CHUNKLOSS_CHECK(t.view.defined() && t.view.device() == Device::kCpu,
                    "serialize_safetensors: ", "tensor \"", t.name, "\" must be a host view, got ",
                    t.view.str());
    json shape = json::array();
    for (int d = 0; d < t.view.ndim(); ++d) shape.push_back(t.view.size(d));
    header[t.name] = {{"dtype", dtype_tag(t.view.dtype())},
                      {"shape", shape},
                      {"data_offsets", {offset, offset + t.view.nbytes()}}};
    offset += t.view.nbytes();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t len = text.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &len, 8);
  out.reserve(8 + text.size() + offset);
  out += text;
  for (const NamedTensor& t : tensors) {
    if (t.view.nbytes() > 0) out.append(static_cast<const char*>(t.view.data()), t.view.nbytes());
  }
  return out;
}

void write_safetensors(const std::string& path, std::span<const NamedTensor> tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_file_atomically(path, serialize_safetensors(tensors, metadata));
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = detail::temp_path(path);
  detail::write_temp_file(tmp, bytes);
  try {
    detail::rename_file(tmp, path);
  } catch (...) {
    detail::remove_file_quietly(tmp);
    throw;
  }
  detail::sync_parent_dir(path);
}

}  // namespace chunkloss::model
