// The in-process group: ranks are threads; a collective publishes each rank's host buffer,
// waits for all ranks, reads the others' and waits again before any buffer may change.
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string_view>
#include <type_traits>
#include <vector>

#include "chunkloss/core/error.h"
#include "chunkloss/dist/communicator.h"
#if CHUNKLOSS_HAVE_CUDA
#include "chunkloss/gpu/check.h"
#include "chunkloss/gpu/context.h"
#endif

namespace chunkloss::dist {

namespace {

// Copies between a buffer on the context's device and host memory; for a CUDA context on its
// stream, which is synchronised.
void copy(const Context& ctx, void* dst, const void* src, std::size_t bytes, bool to_host) {
  if (ctx.device() == Device::kCpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if CHUNKLOSS_HAVE_CUDA
  const auto& g = static_cast<const gpu::Context&>(ctx);
  g.activate();
  const auto s = static_cast<cudaStream_t>(g.stream());
  CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(
      dst, src, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, s));
  CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(s));
#else
  (void)dst, (void)src, (void)bytes, (void)to_host;
  CHUNKLOSS_FAIL("InProcessGroup: a CUDA context in a build without CUDA support");
#endif
}

}  // namespace

struct InProcessGroup::State {
  class Rank final : public Communicator {
   public:
    Rank(State& s, int rank) : s_(s), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return static_cast<int>(s_.ranks.size()); }

    void all_reduce_sum(const Context& ctx, float* data, std::int64_t n) override {
      reduce(ctx, data, n);
    }
    void all_reduce_sum(const Context& ctx, double* data, std::int64_t n) override {
      reduce(ctx, data, n);
    }

    void all_gather(const Context& ctx, const void* send, void* recv, std::size_t bytes) override {
      s_.or_abort([&] {
        host_bytes_.resize(bytes);
        gathered_.resize(bytes * s_.slots.size());
        copy(ctx, host_bytes_.data(), send, bytes, true);
      });
      s_.publish(rank_, host_bytes_.data(), bytes, "all_gather of bytes");
      for (std::size_t r = 0; r < s_.slots.size(); ++r)
        std::memcpy(gathered_.data() + r * bytes, s_.slots[r], bytes);
      s_.wait();
      copy(ctx, recv, gathered_.data(), gathered_.size(), false);
    }

   private:
    template <typename T>
    void reduce(const Context& ctx, T* data, std::int64_t n) {
      const auto count = static_cast<std::size_t>(n);
      s_.or_abort([&] {
        CHUNKLOSS_CHECK(n >= 0, "InProcessGroup::all_reduce_sum: n=", n, " < 0");
        host_bytes_.resize(count * sizeof(T));
        sum_.assign(count, 0.0);
        copy(ctx, host_bytes_.data(), data, host_bytes_.size(), true);
      });
      s_.publish(
          rank_, host_bytes_.data(), host_bytes_.size(),
          std::is_same_v<T, float> ? "all_reduce_sum of floats" : "all_reduce_sum of doubles");
      for (const void* p : s_.slots) {
        const auto* v = static_cast<const T*>(p);
        for (std::size_t i = 0; i < count; ++i) sum_[i] += v[i];
      }
      s_.wait();  // every rank has read every buffer
      T* out = reinterpret_cast<T*>(host_bytes_.data());
      for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(sum_[i]);
      copy(ctx, data, out, host_bytes_.size(), false);
    }

    State& s_;
    int rank_;
    std::vector<double> sum_;
    std::vector<unsigned char> host_bytes_, gathered_;
  };

  explicit State(int size)
      : slots(static_cast<std::size_t>(size)), sizes(slots.size()), whats(slots.size()) {
    for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<Rank>(*this, r));
  }

  // Puts rank r's buffer in its slot and waits for every rank's; the collectives (`what`: the
  // operation and the element type) and the sizes must agree (else every rank throws, after a
  // second barrier so no rank's next call overwrites a slot that another is still reading).
  void publish(int r, const void* p, std::size_t bytes, std::string_view what) {
    slots[static_cast<std::size_t>(r)] = p;
    sizes[static_cast<std::size_t>(r)] = bytes;
    whats[static_cast<std::size_t>(r)] = what;
    wait();
    std::size_t other = 0;
    while (other < sizes.size() && sizes[other] == bytes && whats[other] == what) ++other;
    if (other == sizes.size()) return;
    const std::size_t theirs = sizes[other];
    const std::string_view their_what = whats[other];
    wait();
    CHUNKLOSS_FAIL("InProcessGroup: rank ", r, " calls ", what, " with ", bytes, " bytes, rank ",
                   other, " calls ", their_what, " with ", theirs, " bytes");
  }

  // A rank's part of a collective before it publishes (checks, its buffers, staging its data):
  // if that throws, the others would wait for it in `publish` forever, so the group is aborted
  // first. (After publishing nothing allocates; a failed copy back to the device comes after the
  // last barrier.)
  template <typename Fn>
  void or_abort(Fn&& fn) {
    try {
      fn();
    } catch (...) {
      abort();
      throw;
    }
  }

  // A barrier over all ranks (throws once the group is aborted).
  void wait() {
    std::unique_lock lock(mutex);
    CHUNKLOSS_CHECK(!aborted, kAborted);
    const std::uint64_t gen = generation;
    if (++arrived == ranks.size()) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || aborted; });
    CHUNKLOSS_CHECK(generation != gen, kAborted);
  }

  void abort() {
    const std::lock_guard lock(mutex);
    aborted = true;
    cv.notify_all();
  }

  static constexpr const char* kAborted =
      "InProcessGroup: the group was aborted (a rank failed outside the collectives)";

  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<const void*> slots;
  std::vector<std::size_t> sizes;
  std::vector<std::string_view> whats;
  std::mutex mutex;
  std::condition_variable cv;
  std::size_t arrived = 0;
  std::uint64_t generation = 0;
  bool aborted = false;
};

InProcessGroup::InProcessGroup(int size) {
  CHUNKLOSS_CHECK(size >= 1, "InProcessGroup: size must be >= 1, got ", size);
  state_ = std::make_unique<State>(size);
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const { return static_cast<int>(state_->ranks.size()); }

Communicator& InProcessGroup::comm(int rank) {
  CHUNKLOSS_CHECK(rank >= 0 && rank < size(), "InProcessGroup::comm: rank ", rank, " outside [0, ",
                  size(), ")");
  return *state_->ranks[static_cast<std::size_t>(rank)];
}

void InProcessGroup::abort() { state_->abort(); }

}  // namespace chunkloss::dist
