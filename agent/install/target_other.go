//go:build !linux

package install

import "io/fs"

// exclusiveOpen is 0: only Linux gives O_EXCL on a block device a meaning
// (see target_linux.go). The agent runs on Linux; other systems build this
// package for CheckRequest.
const exclusiveOpen = 0

// noFollow is 0: not every system has O_NOFOLLOW, and a file target is
// for tests, which run on Linux.
const noFollow = 0

// mountedAt cannot tell on this system.
func mountedAt(fs.FileInfo) string { return "" }
