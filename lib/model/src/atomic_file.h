// Internal: the steps of an atomic file replacement (write + fsync a temporary, rename, fsync the
// directory), separate so a checkpoint can stage all its files before renaming any; and the
// bounded reading of a checkpoint's files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace chunkloss::model::detail {

/// The temporary beside `path`: path + ".tmp".
std::string temp_path(const std::string& path);
/// Creates/truncates `tmp`, writes `bytes`, fsyncs and closes it. On failure removes `tmp`
/// (when it is a regular file) and throws chunkloss::Error naming it and the failing call.
void write_temp_file(const std::string& tmp, std::string_view bytes);
/// rename(tmp, path); throws chunkloss::Error on failure.
void rename_file(const std::string& tmp, const std::string& path);
/// fsyncs the directory holding `path`, making renames durable.
void sync_parent_dir(const std::string& path);
/// Removes `path` if it is a regular file; ignores errors.
void remove_file_quietly(const std::string& path);
/// The type of what `path` names, links followed: file_type::not_found when nothing; throws
/// chunkloss::Error naming it when it cannot be told (a symbolic-link loop, a permission).
std::filesystem::file_type file_type_of(const std::string& path);
/// Checks the start of a file before the rest is read: its first bytes and its size.
using StartCheck = std::function<void(std::string_view first, std::uint64_t size)>;
/// The bytes of the regular file `path`; a directory, device or pipe is refused by name. When
/// `check` is given, it sees the file's first min(size, start_bytes) bytes and its size before
/// the rest is read, so a file that is not what it should be fails before a large read (a sparse
/// file of terabytes, say). Throws chunkloss::Error naming `path` and the failing call.
std::string read_regular_file(const std::string& path, std::size_t start_bytes = 0,
                              const StartCheck& check = {});

}  // namespace chunkloss::model::detail
