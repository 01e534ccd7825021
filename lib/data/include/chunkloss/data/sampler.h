// Seeded, platform-independent shuffling and epoch batching: the order is a pure function of
// (seed, epoch), so a resumed run sees exactly the batches an uninterrupted one would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace chunkloss::data {

/// A permutation of 0..n-1: Fisher-Yates driven by std::mt19937_64(seed), with bounded draws by
/// rejection sampling (not std::shuffle or std::uniform_int_distribution, whose algorithms
/// differ between standard libraries). Same (n, seed) -> same permutation everywhere.
std::vector<std::size_t> shuffled_indices(std::size_t n, std::uint64_t seed);

/// Splits each epoch of `n` examples into batches of `batch_size` indices.
/// Epoch e is shuffled with shuffled_indices(n, epoch_seed(seed, e)) (or kept in order when
/// `shuffle` is false). The last short batch is kept unless `drop_last`.
class BatchSampler {
 public:
  /// Throws chunkloss::Error when n == 0, batch_size < 1, or drop_last leaves no batch.
  BatchSampler(std::size_t n, std::size_t batch_size, std::uint64_t seed, bool shuffle = true,
               bool drop_last = false);

  std::size_t batches_per_epoch() const;
  /// All batches of epoch `epoch`, each a list of example indices.
  std::vector<std::vector<std::size_t>> epoch(std::uint64_t epoch) const;
  /// The seed of one epoch's permutation (splitmix64 of seed and epoch).
  static std::uint64_t epoch_seed(std::uint64_t seed, std::uint64_t epoch);

 private:
  std::size_t n_;
  std::size_t batch_size_;
  std::uint64_t seed_;
  bool shuffle_;
  bool drop_last_;
};

}  // namespace chunkloss::data
