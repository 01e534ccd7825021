// libFuzzer target: the safetensors reader on arbitrary bytes. Any input either parses or throws
// chunkloss::Error; a file that parses has entries inside its data section that tile it exactly,
// and every F32 entry can be copied out.
#include <chunkloss/core/error.h>
#include <chunkloss/model/safetensors.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  using namespace chunkloss;
  try {
    const model::SafetensorsFile f = model::SafetensorsFile::parse(
        std::string(reinterpret_cast<const char*>(bytes), size), "<fuzz>");
    std::size_t covered = 0;
    for (const model::SafetensorsEntry& e : f.tensors()) {
      require(e.begin == covered && e.end >= e.begin && e.end <= size);
      covered = e.end;
      require(f.find(e.name) != nullptr);
      if (e.dtype == "F32") {
        std::vector<float> out((e.end - e.begin) / sizeof(float));
        f.copy_f32(e, out);
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
