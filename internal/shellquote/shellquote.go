// Package shellquote quotes words for a POSIX shell (sh), for the commands
// Shepherd sends over SSH and the command lines it prints for operators to
// paste. A quoted word is one word to the shell, whatever it holds: no
// expansion, no splitting, no command substitution.
package shellquote

import "strings"

// Quote returns s in single quotes, each single quote inside written as
// '\” (close, escaped quote, reopen): the one quoting in which sh treats
// every other character literally.
func Quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Join quotes every word and joins them with spaces, as one command line.
func Join(words ...string) string {
	q := make([]string, len(words))
	for i, w := range words {
		q[i] = Quote(w)
	}
	return strings.Join(q, " ")
}

// plain are the characters a word may hold and still need no quotes.
const plain = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@=,+%"

// Readable quotes s only if the shell would read it otherwise, so that a
// command line printed for a person stays easy to read: a non-empty word
// of letters, digits and -_./:@=,+% is left as it is.
func Readable(s string) string {
	if s != "" && strings.Trim(s, plain) == "" {
		return s
	}
	return Quote(s)
}
