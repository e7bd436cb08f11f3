package main

import "errors"

// open is seal's inverse: only the tests read a sealed value back.
func (k *masterKey) open(sealed, aad []byte) ([]byte, error) {
	n := k.aead.NonceSize()
	if len(sealed) < n {
		return nil, errors.New("sealed value too short")
	}
	return k.aead.Open(nil, sealed[:n], sealed[n:], aad)
}
