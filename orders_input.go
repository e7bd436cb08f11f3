package main

// Strict reading of client input, for any feature: JSON keys as spelled,
// text a person could type, ASCII tokens.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// keyProblem walks the object keys of a JSON body and names the first one
// encoding/json would take in a way the client did not mean: a key given
// twice in one object (encoding/json keeps the last, so {"title":"A",
// "title":"B"} stores B), or a key that matches a field only when case is
// ignored ("TITLE", "Title", even "ſize" with a long s), which
// encoding/json accepts although DisallowUnknownFields is set. A body that is
// not JSON is left to the decoder, which names the syntax error.
//
// It runs on every request body, so one that is a valid JSON value (every
// well-formed request) is walked byte by byte without allocating
// (scanKeys); any other body takes the token walk (keyProblemByTokens),
// which reports what lies before the syntax error exactly as before.
func keyProblem(raw []byte, names []string) string {
	if len(names) <= 64 && json.Valid(raw) {
		return scanKeys(raw, names)
	}
	return keyProblemByTokens(raw, names)
}

// scanKeys is keyProblem for raw known to be one valid JSON value: it only
// has to tell keys from the other strings. Keys it has to compare are used as
// they are in the body unless they hold an escape; those are unquoted first,
// as encoding/json would.
func scanKeys(raw []byte, names []string) string {
	type object struct {
		seen     uint64 // bit i: names[i] was a key of this object
		isObject bool
		awaitKey bool
	}
	var buf [8]object
	stack := buf[:0]
	for i := 0; i < len(raw); i++ {
		switch c := raw[i]; c {
		case '{', '[':
			stack = append(stack, object{isObject: c == '{', awaitKey: c == '{'})
		case '}', ']':
			stack = stack[:len(stack)-1]
			if len(stack) == 0 {
				return ""
			}
		case ',':
			if top := &stack[len(stack)-1]; top.isObject {
				top.awaitKey = true
			}
		case '"':
			end := i + 1
			escaped := false
			for raw[end] != '"' {
				if raw[end] == '\\' {
					escaped = true
					end++
				}
				end++
			}
			quoted := raw[i : end+1]
			i = end
			if len(stack) == 0 || !stack[len(stack)-1].awaitKey {
				continue // a value
			}
			top := &stack[len(stack)-1]
			top.awaitKey = false
			key := quoted[1 : len(quoted)-1]
			if escaped {
				var s string
				_ = json.Unmarshal(quoted, &s) // valid: json.Valid said so
				key = []byte(s)
			}
			if problem := checkKey(key, names, &top.seen); problem != "" {
				return problem
			}
		}
	}
	return ""
}

// checkKey marks key seen among names in one object, or says what is wrong
// with it: given twice, or a name only when case is ignored.
func checkKey(key []byte, names []string, seen *uint64) string {
	for i, n := range names {
		if string(key) == n {
			if *seen&(1<<i) != 0 {
				return fmt.Sprintf("duplicate field %s", quoteKey(string(key)))
			}
			*seen |= 1 << i
			return ""
		}
	}
	for _, n := range names {
		if bytes.EqualFold(key, []byte(n)) {
			return fmt.Sprintf("unknown field %s: field names are case-sensitive, this one is %q", quoteKey(string(key)), n)
		}
	}
	return ""
}

// keyProblemByTokens is keyProblem by encoding/json's token stream: slower,
// but it stops at a syntax error exactly where the decoder would.
func keyProblemByTokens(raw []byte, names []string) string {
	type object struct {
		seen     map[string]bool
		awaitKey bool
	}
	var stack []*object
	dec := json.NewDecoder(bytes.NewReader(raw))
	for {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		var top *object
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if key, ok := tok.(string); ok && top != nil && top.awaitKey {
			top.awaitKey = false
			switch {
			case slices.Contains(names, key) && top.seen[key]:
				return fmt.Sprintf("duplicate field %s", quoteKey(key))
			case slices.Contains(names, key):
				top.seen[key] = true
			default:
				for _, n := range names {
					if strings.EqualFold(key, n) {
						return fmt.Sprintf("unknown field %s: field names are case-sensitive, this one is %q", quoteKey(key), n)
					}
				}
			}
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &object{seen: map[string]bool{}, awaitKey: true})
			continue
		case json.Delim('['):
			stack = append(stack, &object{}) // an array: no keys
			continue
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
			if len(stack) == 0 {
				return "" // the first value ended; trailing data is the decoder's to refuse
			}
			top = stack[len(stack)-1]
		}
		if top != nil && top.seen != nil {
			top.awaitKey = true // a member's value ended: a key comes next
		}
	}
}

// quoteKey quotes a client's key for an error message, short and in ASCII,
// so neither its length nor its characters reach logs and terminals as sent.
func quoteKey(key string) string {
	if utf8.RuneCountInString(key) > 40 {
		key = string([]rune(key)[:40]) + "…"
	}
	return strconv.QuoteToASCII(key)
}

// jsonProblem says what is wrong with a body in the client's terms: the field
// and the JSON type it needs, never a Go type name or a decoder internal.
func jsonProblem(err error) string {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr):
		field := typeErr.Field
		if field == "" {
			field = "the body"
		}
		return fmt.Sprintf("%s: expected %s, got %s", field, jsonKind(typeErr.Type), typeErr.Value)
	case errors.As(err, &syntaxErr):
		return fmt.Sprintf("malformed JSON at byte %d", syntaxErr.Offset)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "the JSON object is empty or ends too early"
	}
	// The decoder's unknown-field error names only the client's own key.
	if field, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		return "unknown field " + field
	}
	return "the body does not match the expected JSON object"
}

// jsonKind names the JSON type a Go type is decoded from.
func jsonKind(t reflect.Type) string {
	if t == nil {
		return "another type"
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Bool:
		return "true or false"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	}
	return "another type"
}

// textProblem says what keeps s from being stored or searched as text a
// person reads, or "" when nothing does. Refused: invalid UTF-8; control
// characters (C0 incl. NUL, DEL, C1: they break logs, terminals and some
// drivers); U+FFFD, which is what encoding/json makes of a lone surrogate
// such as "\ud800" (the client sent something else than what would be
// stored); and format characters (Unicode Cf: invisible, so "\u200b" looks
// like an empty name), bidi controls above all (U+202E turns "Ada\u202Egpj.exe"
// into a different-looking name in every view). The zero-width joiners U+200C
// and U+200D stay allowed: Persian, Indic scripts and emoji need them.
func textProblem(s string) string {
	if !utf8.ValidString(s) {
		return "must be valid UTF-8"
	}
	for _, r := range s {
		switch {
		case r == utf8.RuneError:
			return `must not contain U+FFFD (a replacement character; a lone surrogate such as \ud800 becomes one)`
		case unicode.IsControl(r):
			return "must not contain control characters"
		case unicode.Is(unicode.Bidi_Control, r):
			return fmt.Sprintf("must not contain the bidi control U+%04X", r)
		case unicode.Is(unicode.Cf, r) && r != '\u200c' && r != '\u200d':
			return fmt.Sprintf("must not contain the invisible format character U+%04X", r)
		}
	}
	return ""
}

// visible reports whether s shows at least one character: a name made of
// spaces and joiners only is empty to whoever reads it.
func visible(s string) bool {
	return strings.IndexFunc(s, func(r rune) bool { return unicode.IsGraphic(r) && !unicode.IsSpace(r) }) >= 0
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return s != ""
}
