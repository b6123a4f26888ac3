/* Lowercase hex digits to octets, shared by the Index Service's compiled modules (_keytable.c,
 * _puts.c): a key or digest in a request is checked and decoded in the same pass. */
#ifndef KVSP_INDEX_HEX_H
#define KVSP_INDEX_HEX_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h> /* every x86-64 CPU has SSE2 */
#endif

/* Eight lowercase hex digits -> four octets, eight at a time (SWAR); -1 if any is not one of
 * 0-9 a-f. Every byte is below 0x80 before the additions, so no carry crosses a byte. */
static inline int
hex8(const unsigned char *digits, unsigned char *octets)
{
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    uint64_t x;
    memcpy(&x, digits, 8);
    if (x & high) {
        return -1;
    }
    uint64_t digit = (x + 0x50 * ones) & ~(x + 0x46 * ones);  /* 0x30 <= b < 0x3a */
    uint64_t letter = (x + 0x1f * ones) & ~(x + 0x19 * ones); /* 0x61 <= b < 0x67 */
    if (((digit | letter) & high) != high) {
        return -1;
    }
    uint64_t v = (x & 0x0f * ones) + ((letter & high) >> 7) * 9; /* byte k: value of digit k */
    v = ((v << 4) | (v >> 8)) & 0x00ff00ff00ff00ffULL;            /* pairs in bytes 0, 2, 4, 6 */
    v = (v | (v >> 8)) & 0x0000ffff0000ffffULL;
    v = (v | (v >> 16)) & 0x00000000ffffffffULL;
    uint32_t packed = (uint32_t)v;
    memcpy(octets, &packed, 4);
    return 0;
}

#if defined(__SSE2__)
/* 32 lowercase hex digits -> 16 octets, 16 digits a step; -1 if any is not one of 0-9 a-f.
 * Signed byte compares: a byte of 0x80 and above is negative, so below '0', never a digit. */
static inline int
hex32_octets(const unsigned char *digits, unsigned char *octets)
{
    const __m128i low_byte = _mm_set1_epi16(0x00ff);
    __m128i pairs[2];
    int valid = 0xffff;
    for (int half = 0; half < 2; half++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(digits + 16 * half));
        __m128i digit = _mm_and_si128(_mm_cmpgt_epi8(x, _mm_set1_epi8('0' - 1)),
                                      _mm_cmplt_epi8(x, _mm_set1_epi8('9' + 1)));
        __m128i letter = _mm_and_si128(_mm_cmpgt_epi8(x, _mm_set1_epi8('a' - 1)),
                                       _mm_cmplt_epi8(x, _mm_set1_epi8('f' + 1)));
        valid &= _mm_movemask_epi8(_mm_or_si128(digit, letter));
        /* each byte's value: '0'-'9' less '0', 'a'-'f' less 'a' - 10 */
        __m128i value = _mm_sub_epi8(_mm_sub_epi8(x, _mm_set1_epi8('0')),
                                     _mm_and_si128(letter, _mm_set1_epi8('a' - '0' - 10)));
        /* little-endian 16-bit lanes hold (high digit, low digit): high << 4 | low */
        pairs[half] = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(value, low_byte), 4),
                                   _mm_srli_epi16(value, 8));
    }
    _mm_storeu_si128((__m128i *)octets, _mm_packus_epi16(pairs[0], pairs[1]));
    return valid == 0xffff ? 0 : -1;
}

#else
/* 32 lowercase hex digits -> 16 octets; -1 if any is not one of 0-9 a-f. */
static inline int
hex32_octets(const unsigned char *digits, unsigned char *octets)
{
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        bad |= hex8(digits + 8 * i, octets + 4 * i);
    }
    return bad;
}
#endif

/* 64 lowercase hex digits -> the 32 octets of a key or digest; -1 if they are not. */
static inline int
hex64(const unsigned char *digits, unsigned char *octets)
{
    return hex32_octets(digits, octets) | hex32_octets(digits + 32, octets + 16);
}

#endif
