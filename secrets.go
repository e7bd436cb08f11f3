package main

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac" // demo:begin (this line) demo:end
	"crypto/rand" // demo:begin (this line) demo:end
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
)

// masterKeyProvider is where the 32-byte master key comes from. The demo ships
// the environment and a file (a mounted Kubernetes/Docker secret); Vault or a
// cloud KMS plug in here as another provider whose load fetches or unwraps the
// key — nothing else in the process changes.
type masterKeyProvider interface {
	name() string
	load(ctx context.Context) ([]byte, error)
}

type envKeyProvider struct{ value string }

func (envKeyProvider) name() string { return "env" }
func (p envKeyProvider) load(context.Context) ([]byte, error) {
	return decodeMasterKey(p.value, "KUMIKO_MASTER_KEY")
}

type fileKeyProvider struct{ path string }

func (fileKeyProvider) name() string { return "file" }
func (p fileKeyProvider) load(context.Context) ([]byte, error) {
	raw, err := os.ReadFile(p.path)
	if err != nil {
		return nil, fmt.Errorf("reading KUMIKO_MASTER_KEY_FILE: %w", err)
	}
	return decodeMasterKey(strings.TrimSpace(string(raw)), "KUMIKO_MASTER_KEY_FILE "+p.path)
}

func decodeMasterKey(b64, source string) ([]byte, error) {
	key, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return nil, fmt.Errorf("%s is not valid base64: %w", source, err)
	}
	if len(key) != 32 {
		return nil, fmt.Errorf("%s decodes to %d bytes, want 32 (generate one with: head -c 32 /dev/urandom | base64)", source, len(key))
	}
	return key, nil
}

// masterKey seals small secrets with AES-256-GCM and authenticates values
// with HMAC-SHA256 (mac). Its id (a hash prefix) can be logged and stored
// next to sealed data to tell which key sealed it; the key itself never
// leaves this type.
type masterKey struct {
	id     string
	aead   cipher.AEAD
	macKey []byte // derived from the key, so no MAC input can ever meet the cipher's key
}

func newMasterKey(key []byte) (*masterKey, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("creating the AES cipher: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("creating the GCM mode: %w", err)
	}
	macKey, err := hkdf.Key(sha256.New, key, nil, "mac", sha256.Size)
	if err != nil {
		return nil, fmt.Errorf("deriving the MAC key: %w", err)
	}
	sum := sha256.Sum256(key)
	return &masterKey{id: hex.EncodeToString(sum[:4]), aead: aead, macKey: macKey}, nil
}

// demo:begin (a bare copy seals and signs nothing)
// mac authenticates msg for one purpose: the same msg under another purpose
// gives an unrelated tag, so a value minted for one use is worthless for any
// other. Compare tags with hmac.Equal, never ==.
func (k *masterKey) mac(purpose string, msg []byte) []byte {
	h := hmac.New(sha256.New, k.macKey)
	h.Write([]byte(purpose))
	h.Write([]byte{0}) // purposes are text: a NUL ends one unambiguously
	h.Write(msg)
	return h.Sum(nil)
}

// seal encrypts plaintext; aad binds the result to its context (e.g. "note:42")
// so a sealed value cannot be moved to another row. The service never reads
// a sealed value back: its inverse, open, is the tests' (secrets_test.go).
func (k *masterKey) seal(plaintext, aad []byte) []byte {
	nonce := make([]byte, k.aead.NonceSize())
	rand.Read(nonce) // crypto/rand.Read never fails on Linux (Go ≥1.24 panics instead)
	return k.aead.Seal(nonce, nonce, plaintext, aad)
}

// demo:end

// secrets is phase 3. Without a key set, it loads none: a service whose
// features use none needs none, and phase 6 refuses a feature that uses it.
func (a *app) secrets(ctx context.Context, p *phaseRun) error {
	var provider masterKeyProvider
	switch {
	case a.cfg.MasterKeyFile != "":
		provider = fileKeyProvider{path: a.cfg.MasterKeyFile}
	case a.cfg.MasterKey != "":
		provider = envKeyProvider{value: a.cfg.MasterKey}
	default:
		p.note = "no master key set"
		return nil
	}
	raw, err := provider.load(ctx)
	if err != nil {
		return err
	}
	key, err := newMasterKey(raw)
	if err != nil {
		return err
	}
	a.masterKey = key
	p.note = fmt.Sprintf("provider=%s keyId=%s", provider.name(), key.id)
	return nil
}
